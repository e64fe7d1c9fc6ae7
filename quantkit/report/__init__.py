"""Paper 000's Table 2 from a results JSON (docs/report-format.md), and the CI gate on quantization degradation.

    quantkit report RESULTS.json --out DIR          report.{md,csv,json,html}
    quantkit gate --baseline B.json --current C.json [--config gate.yaml]   exit 0 pass, 1 regression, 2 bad input

Units: points 0-100 as the paper prints; Delta = score(recipe) - score(BF16 of the same variant), negative = worse.
"""
