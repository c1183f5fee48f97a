"""Precision check of a conversion: next-token logits of the HF model vs the Megatron model.

For a few fixed multilingual harmony prompts, both models predict the next token after
``<|start|>assistant``. Per prompt and overall the report gives the max and mean absolute
logit difference, whether the top-1 tokens agree and the top-5 overlap. The check fails when
any of them passes the tolerance for the weights dtype:

| dtype | max abs | mean abs | top-1 agreement | top-5 overlap |
|---|---|---|---|---|
| fp32 | 5e-3 | 5e-4 | 1.0 | 0.95 |
| fp16 | 0.5 | 0.05 | 0.9 | 0.85 |
| bf16 | 1.0 | 0.1 | 0.9 | 0.8 |

Why these numbers: in fp32 the two implementations differ only by summation order and fused
kernels, ~1e-6 relative per op; logits of magnitude ~10–30 after 24–36 layers then agree to
~1e-4, so 5e-3 leaves headroom yet catches a wrong mapping (which moves logits by O(1)) and a
silent TF32 matmul. bf16 keeps 8 mantissa bits (relative rounding 2^-9 ≈ 0.2%): rounding a
logit of 30 alone moves it by ~0.06, and different fusion orders compound that through the
layers to a few tenths on the worst of ~200k vocabulary entries, so the max is 1.0 and the
mean (dominated by the many small logits) 0.1. fp16 has 11 mantissa bits (8× finer) but a
narrow range; its bounds sit between. Top-1 may flip where the HF model's two best tokens are
nearly tied, so with ten prompts one flip is allowed in 16-bit and none in fp32.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from core.atomic import atomic_write_text

log = logging.getLogger(__name__)

TOP_K = 5
DType = Literal["bf16", "fp16", "fp32"]


class Tolerance(BaseModel):
    """Bounds a conversion must stay within (see the module docstring for the reasoning)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_abs_diff: float = Field(gt=0)
    mean_abs_diff: float = Field(gt=0)
    min_top1_agreement: float = Field(ge=0, le=1)
    min_topk_agreement: float = Field(ge=0, le=1)


TOLERANCES: dict[str, Tolerance] = {
    "fp32": Tolerance(
        max_abs_diff=5e-3, mean_abs_diff=5e-4, min_top1_agreement=1.0, min_topk_agreement=0.95
    ),
    "fp16": Tolerance(
        max_abs_diff=0.5, mean_abs_diff=0.05, min_top1_agreement=0.9, min_topk_agreement=0.85
    ),
    "bf16": Tolerance(
        max_abs_diff=1.0, mean_abs_diff=0.1, min_top1_agreement=0.9, min_topk_agreement=0.8
    ),
}


class VerificationPrompt(BaseModel):
    """One fixed prompt: a user message with developer instructions, rendered as harmony."""

    model_config = ConfigDict(frozen=True)

    name: str
    language: str
    instructions: str
    user: str


def _prompt(name: str, language: str, user: str) -> VerificationPrompt:
    return VerificationPrompt(
        name=name,
        language=language,
        instructions=f"reasoning language: {language}\n\nYou are a helpful assistant.",
        user=user,
    )


VERIFICATION_PROMPTS: tuple[VerificationPrompt, ...] = (
    _prompt("en-minutes", "English", "How many minutes are in three and a half hours?"),
    _prompt("en-capital", "English", "What is the capital of Australia?"),
    _prompt("fr-minutes", "French", "Combien de minutes y a-t-il dans trois heures et demie ?"),
    _prompt("fr-recipe", "French", "Donne-moi une idée de dîner rapide."),
    _prompt("de-minutes", "German", "Wie viele Minuten hat dreieinhalb Stunden?"),
    _prompt("de-weather", "German", "Warum ist der Himmel blau?"),
    _prompt("es-minutes", "Spanish", "¿Cuántos minutos hay en tres horas y media?"),
    _prompt("es-advice", "Spanish", "¿Cómo puedo dormir mejor?"),
    _prompt("it-minutes", "Italian", "Quanti minuti ci sono in tre ore e mezza?"),
    _prompt("it-travel", "Italian", "Cosa visitare a Roma in un giorno?"),
)


class PromptComparison(BaseModel):
    """HF vs Megatron on one prompt's next-token logits."""

    name: str
    tokens: int
    max_abs_diff: float
    mean_abs_diff: float
    hf_top1: int
    megatron_top1: int
    top1_match: bool
    hf_top1_margin: float
    """HF's best logit minus its second best: flips below ~2× the max diff are near-ties."""
    topk_agreement: float
    """|top-k(HF) ∩ top-k(Megatron)| / k."""


class VerificationReport(BaseModel):
    """The precision check's outcome, per prompt and overall."""

    dtype: DType
    tolerance: Tolerance
    top_k: int
    vocab_size: int
    prompts: list[PromptComparison]
    max_abs_diff: float
    mean_abs_diff: float
    top1_agreement: float
    topk_agreement: float
    passed: bool
    failures: list[str]
    hf_dir: str = ""
    megatron_dir: str = ""

    def to_json(self) -> str:
        """The report as indented JSON."""
        return self.model_dump_json(indent=2)

    def to_markdown(self) -> str:
        """The report as Markdown: verdict, overall metrics vs tolerance, per-prompt table."""
        t = self.tolerance
        verdict = "passed" if self.passed else "FAILED"
        lines = [
            f"# Megatron conversion precision check: {verdict}",
            "",
            f"Next-token logits of the HF model vs the converted Megatron model on "
            f"{len(self.prompts)} fixed prompts, weights in {self.dtype}, vocabulary "
            f"{self.vocab_size}.",
        ]
        if self.hf_dir or self.megatron_dir:
            lines += [
                "",
                f"- HF model: `{self.hf_dir}`",
                f"- Megatron checkpoint: `{self.megatron_dir}`",
            ]
        lines += [
            "",
            "| metric | value | tolerance |",
            "|---|---|---|",
            f"| max abs logit diff | {self.max_abs_diff:.3g} | ≤ {t.max_abs_diff:g} |",
            f"| mean abs logit diff | {self.mean_abs_diff:.3g} | ≤ {t.mean_abs_diff:g} |",
            f"| top-1 agreement | {self.top1_agreement:.3f} | ≥ {t.min_top1_agreement:g} |",
            f"| top-{self.top_k} overlap | {self.topk_agreement:.3f} | "
            f"≥ {t.min_topk_agreement:g} |",
            "",
            f"| prompt | tokens | max abs | mean abs | top-1 HF / Megatron | HF top-1 margin | "
            f"top-{self.top_k} overlap |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in self.prompts:
            mark = "" if p.top1_match else " ✗"
            lines.append(
                f"| {p.name} | {p.tokens} | {p.max_abs_diff:.3g} | {p.mean_abs_diff:.3g} | "
                f"{p.hf_top1} / {p.megatron_top1}{mark} | {p.hf_top1_margin:.3g} | "
                f"{p.topk_agreement:.2f} |"
            )
        if self.failures:
            lines += ["", "## Failures", "", *(f"- {f}" for f in self.failures)]
        return "\n".join(lines) + "\n"


class PrecisionCheckFailed(RuntimeError):
    """The converted model's logits differ from the HF model's beyond the tolerance."""

    def __init__(self, report: VerificationReport, where: str = "") -> None:
        self.report = report
        super().__init__(
            "Megatron conversion failed its precision check"
            + (f" (report: {where})" if where else "")
            + ": "
            + "; ".join(report.failures)
        )


def compare_logits(
    hf_logits,
    megatron_logits,
    dtype: DType,
    names: Sequence[str] | None = None,
    tokens: Sequence[int] | None = None,
    tolerance: Tolerance | None = None,
    top_k: int = TOP_K,
) -> VerificationReport:
    """Compare next-token logits of the same prompts from two models.

    Args:
        hf_logits: ``[prompts, vocab]`` float tensor from the HF model (the reference).
        megatron_logits: ``[prompts, vocab']`` from the Megatron model; a vocabulary padded
            by Megatron (``vocab' > vocab``) is cut to ``vocab``.
        dtype: the weights dtype; picks the tolerance unless one is given.
        names: a label per prompt (default ``prompt-<i>``).
        tokens: prompt lengths, for the report.
        tolerance: bounds to use instead of ``TOLERANCES[dtype]``.
        top_k: the k of the top-k overlap.

    Returns:
        The report (``passed`` and ``failures`` say whether it is within tolerance).

    Raises:
        ValueError: shapes that cannot be compared.
    """
    hf, mg = _comparable_logits(hf_logits, megatron_logits)
    vocab = hf.shape[1]
    n = hf.shape[0]
    names = list(names) if names is not None else [f"prompt-{i}" for i in range(n)]
    lengths = list(tokens) if tokens is not None else [0] * n
    k = min(top_k, vocab)
    tolerance = tolerance or TOLERANCES[dtype]
    diff = (hf - mg).abs()
    hf_top = hf.topk(min(max(k, 2), vocab), dim=-1)  # at least 2, for the top-1 margin
    mg_top = mg.topk(k, dim=-1).indices
    rows = []
    for i in range(n):
        values = hf_top.values[i]
        margin = float(values[0] - values[1]) if len(values) > 1 else float("inf")
        overlap = len(set(hf_top.indices[i, :k].tolist()) & set(mg_top[i].tolist())) / k
        rows.append(
            PromptComparison(
                name=names[i],
                tokens=lengths[i],
                max_abs_diff=float(diff[i].max()),
                mean_abs_diff=float(diff[i].mean()),
                hf_top1=int(hf_top.indices[i, 0]),
                megatron_top1=int(mg_top[i, 0]),
                top1_match=int(hf_top.indices[i, 0]) == int(mg_top[i, 0]),
                hf_top1_margin=margin,
                topk_agreement=overlap,
            )
        )
    overall_max = float(diff.max())
    overall_mean = float(diff.mean())
    top1 = sum(r.top1_match for r in rows) / n
    topk = sum(r.topk_agreement for r in rows) / n
    failures = _failures(rows, (overall_max, overall_mean, top1, topk), tolerance, k)
    return VerificationReport(
        dtype=dtype,
        tolerance=tolerance,
        top_k=k,
        vocab_size=vocab,
        prompts=rows,
        max_abs_diff=overall_max,
        mean_abs_diff=overall_mean,
        top1_agreement=top1,
        topk_agreement=topk,
        passed=not failures,
        failures=failures,
    )


def _comparable_logits(hf_logits, megatron_logits):
    """Both logits as float CPU tensors ``[prompts, vocab]``, Megatron's padded vocabulary cut
    to HF's.

    Raises:
        ValueError: other shapes, a smaller Megatron vocabulary, NaN or inf."""
    import torch

    hf = torch.as_tensor(hf_logits).detach().float().cpu()
    mg = torch.as_tensor(megatron_logits).detach().float().cpu()
    if hf.dim() != 2 or mg.dim() != 2 or hf.shape[0] != mg.shape[0]:
        raise ValueError(
            f"logits must be [prompts, vocab] with the same number of prompts; "
            f"HF {tuple(hf.shape)}, Megatron {tuple(mg.shape)}"
        )
    vocab = hf.shape[1]
    if mg.shape[1] < vocab:
        raise ValueError(f"Megatron vocabulary {mg.shape[1]} is smaller than HF's {vocab}")
    mg = mg[:, :vocab]
    if not torch.isfinite(hf).all() or not torch.isfinite(mg).all():
        raise ValueError("logits contain NaN or inf; the model itself is broken")
    return hf, mg


def _failures(
    rows: list[PromptComparison],
    overall: tuple[float, float, float, float],
    tolerance: Tolerance,
    k: int,
) -> list[str]:
    """Each bound of ``tolerance`` the comparison breaks, as a line naming the figure (and the
    worst or flipped prompts); ``overall``: the max and mean absolute difference, the top-1
    agreement and the top-k overlap."""
    overall_max, overall_mean, top1, topk = overall
    failures = []
    if overall_max > tolerance.max_abs_diff:
        worst = max(rows, key=lambda r: r.max_abs_diff)
        failures.append(
            f"max abs logit diff {overall_max:.3g} > {tolerance.max_abs_diff:g} "
            f"(worst prompt {worst.name})"
        )
    if overall_mean > tolerance.mean_abs_diff:
        failures.append(f"mean abs logit diff {overall_mean:.3g} > {tolerance.mean_abs_diff:g}")
    if top1 < tolerance.min_top1_agreement:
        flipped = ", ".join(r.name for r in rows if not r.top1_match)
        failures.append(
            f"top-1 agreement {top1:.3f} < {tolerance.min_top1_agreement:g} (flipped: {flipped})"
        )
    if topk < tolerance.min_topk_agreement:
        failures.append(f"top-{k} overlap {topk:.3f} < {tolerance.min_topk_agreement:g}")
    return failures


def encode_prompts(tokenizer, prompts: Sequence[VerificationPrompt]) -> list[list[int]]:
    """Render each prompt as harmony text (``core.harmony``) and encode it with
    ``tokenizer``; the text ends with ``<|start|>assistant``."""
    from core.harmony import render_prompt

    return [
        tokenizer(render_prompt(p.instructions, p.user), add_special_tokens=False)["input_ids"]
        for p in prompts
    ]


def hf_next_token_logits(model, input_ids: list[list[int]]):
    """``[prompts, vocab]`` float32 logits at the last position, one prompt at a time."""
    import torch

    model.eval()
    rows = []
    with torch.no_grad():
        for ids in input_ids:
            out = model(input_ids=torch.tensor([ids], device=model.device), logits_to_keep=1)
            rows.append(out.logits[0, -1].float().cpu())
    return torch.stack(rows)


def write_report(
    report: VerificationReport, report_path: str | Path, json_path: str | Path | None = None
) -> None:
    """Write the Markdown report to ``report_path`` and, if given, the JSON to ``json_path``."""
    atomic_write_text(Path(report_path), report.to_markdown())
    if json_path is not None:
        atomic_write_text(Path(json_path), report.to_json() + "\n")


def verify_conversion(
    hf_dir: str | Path,
    megatron_dir: str | Path,
    prompts: Sequence[VerificationPrompt] = VERIFICATION_PROMPTS,
    dtype: DType = "bf16",
    report_path: str | Path = "verification_report.md",
    json_path: str | Path | None = None,
    tolerance: Tolerance | None = None,
    device: str | None = None,
) -> VerificationReport:
    """Compare the converted checkpoint with its HF source on ``prompts``; write the report.

    The HF side runs ``transformers`` in ``dtype`` (eager attention on CPU); the Megatron side
    is ``trainer.megatron.bridge.megatron_next_token_logits``.

    Args:
        hf_dir: the HF model the checkpoint was converted from (also gives the tokenizer).
        megatron_dir: the converted Megatron checkpoint.
        prompts: the fixed prompts.
        dtype: the weights dtype of the conversion; picks the tolerance.
        report_path: where the Markdown report goes (written whether or not it passes).
        json_path: where the JSON report goes, if anywhere.
        tolerance: bounds to use instead of ``TOLERANCES[dtype]``.
        device: ``cpu`` / ``cuda``; default CUDA when available.

    Returns:
        The report, when it passed.

    Raises:
        PrecisionCheckFailed: past the tolerance (the report is written first).
    """
    import importlib

    import torch

    from core.modeling import load_causal_lm, load_tokenizer

    bridge = importlib.import_module("trainer.megatron.bridge")  # megatron-core: GPU image

    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    where = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tokenizer = load_tokenizer(hf_dir)
    input_ids = encode_prompts(tokenizer, prompts)
    model = load_causal_lm(hf_dir, torch_dtype, where)
    hf_logits = hf_next_token_logits(model, input_ids)
    del model
    if where.type == "cuda":
        torch.cuda.empty_cache()  # the Megatron model loads next, on the same GPU
    megatron_logits = bridge.megatron_next_token_logits(str(megatron_dir), str(hf_dir), input_ids)
    report = compare_logits(
        hf_logits,
        megatron_logits,
        dtype,
        names=[p.name for p in prompts],
        tokens=[len(ids) for ids in input_ids],
        tolerance=tolerance,
    ).model_copy(update={"hf_dir": str(hf_dir), "megatron_dir": str(megatron_dir)})
    write_report(report, report_path, json_path)
    if not report.passed:
        raise PrecisionCheckFailed(report, str(report_path))
    log.info(
        "precision check passed: max |Δ logit| %.3g, mean %.3g, top-1 %.2f, top-%d %.2f",
        report.max_abs_diff,
        report.mean_abs_diff,
        report.top1_agreement,
        report.top_k,
        report.topk_agreement,
    )
    return report
