"""lm-evaluation-harness scores a local multiple-choice task through its vllm backend.

The check is independent of lm-eval: every per-sample log-likelihood it reports must equal the
transformers forward pass of the same checkpoint (float32, |diff| <= LL_TOL = 1e-3 nats), its accuracy must
equal the accuracy recomputed from the log-likelihoods it reports (exact: the same argmax over the same
numbers), and its choice must be transformers' choice wherever transformers' best two choices are more than
2 * LL_TOL apart.

LL_TOL is derived, not measured: both sides are float32 without quantization, so they differ only by
summation order (vLLM's CPU kernels and oneDNN vs torch, which depends on the machine's ISA). A length-K dot
product carries a relative error ~ lambda sqrt(K) u (u = 2**-24, Higham & Mary 2019; 1.4e-5 at K = 512,
lambda = 10); a few such ops precede each logit of this 2-layer model, log_softmax moves a logprob by at most
2 max|d logit|, and a continuation sums at most a few tokens: ~1e-4 nats at most, LL_TOL leaves 10x. A wrong
model, tokenization or offset moves a log-likelihood by O(1) nats. Comparing argmaxes across the two
implementations is discontinuous (two choices within float32 noise of each other may swap), hence the
2 * LL_TOL guard instead of an unconditional equality.
"""

import json

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import quantkit.models  # noqa: F401
from quantkit.evals.harness import run_lm_eval

LL_TOL = 1e-3  # nats, see the module docstring

ITEMS = [
    ("The opposite of hot is", ["cold", "warm", "loud", "green"], 0),
    ("A function that calls itself is called", ["recursive", "lazy", "frozen", "random"], 0),
    ("Two plus two equals", ["three", "four", "five", "six"], 1),
    ("The file is opened in read", ["mode", "tree", "lamp", "song"], 0),
    ("Water freezes at zero degrees", ["Kelvin", "Celsius", "north", "minutes"], 1),
    ("A list is sorted in ascending", ["order", "river", "window", "engine"], 0),
]
TASK_YAML = """\
task: quantkit_smoke_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
target_delimiter: " "
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def _hf_loglikelihood(model, tok, context: str, continuation: str) -> float:
    ctx = tok(context)["input_ids"]
    whole = tok(context + " " + continuation)["input_ids"]
    assert whole[: len(ctx)] == ctx, "continuation must not merge with the context's last token"
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(logp[i - 1, whole[i]].item() for i in range(len(ctx), len(whole)))


def test_lm_eval_vllm_backend_on_local_task(tiny_checkpoint, tmp_path):
    data = tmp_path / "smoke.jsonl"
    data.write_text("".join(json.dumps(dict(question=q, choices=c, answer=a)) + "\n" for q, c, a in ITEMS))
    (tmp_path / "smoke.yaml").write_text(TASK_YAML.format(data=data))

    results = run_lm_eval(tiny_checkpoint, ["quantkit_smoke_mc"], include_path=tmp_path, backend="vllm")

    samples = sorted(results["samples"]["quantkit_smoke_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(ITEMS)
    tok = AutoTokenizer.from_pretrained(tiny_checkpoint)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    correct = 0
    for sample, (question, choices, answer) in zip(samples, ITEMS):
        reported = [resp[0][0] for resp in sample["resps"]]
        expected = [_hf_loglikelihood(model, tok, question, choice) for choice in choices]
        assert max(abs(r - e) for r, e in zip(reported, expected)) <= LL_TOL, (reported, expected)
        chosen = max(range(len(choices)), key=reported.__getitem__)  # first maximum, as lm-eval's argmax
        first, second = sorted(expected, reverse=True)[:2]
        if first - second > 2 * LL_TOL:  # otherwise float32 noise may legitimately swap the two
            assert chosen == max(range(len(choices)), key=expected.__getitem__), (reported, expected)
        correct += int(chosen == answer)
    assert results["results"]["quantkit_smoke_mc"]["acc,none"] == correct / len(ITEMS)
