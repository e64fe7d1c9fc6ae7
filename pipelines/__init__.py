"""Orchestration (import name `quantkit.pipelines`): models x recipes x suite -> run directory.

Pipeline specs are YAML files in this folder (default.yaml: the embedded default study, the hybrid Table 2 trio;
table2-dense.yaml: the dense trio); the runner is
`study.py` (`quantkit run SPEC`).
"""
