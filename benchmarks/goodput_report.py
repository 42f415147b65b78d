"""The goodput harness's configurations, JSON lines and markdown table
(``benchmarks/goodput_autopilot.py``)."""

from __future__ import annotations

import json
import math
import platform
import statistics
import sys
from typing import Any


def predict(every: float, delta: float, restart: float, mttf: float) -> dict[str, float]:
    """The model's goodput for a save started every ``every`` seconds (``τ = every − δ``)."""
    tau = max(every - delta, 1e-3)
    first = tau / (tau + delta) * (1 - (restart + (tau + delta) / 2) / mttf)
    exact = tau / (mttf * math.exp(restart / mttf) * math.expm1((tau + delta) / mttf))
    return {"predicted_first_order": max(first, 0.0), "predicted_exponential": exact}


def configurations(delta: float | None, mttf: float) -> list[dict[str, Any]]:
    """Fixed intervals around the offline Young optimum from the calibration's ``δ``, and
    auto with the injected rate as its prior."""
    d = delta if delta is not None else 1.0
    young = math.sqrt(2 * d * mttf) + d
    return [
        {"name": "fixed-frequent", "every": round(max(young / 4, d * 1.5), 2)},
        {"name": "fixed-young", "every": round(young, 2)},
        {"name": "fixed-rare", "every": round(young * 3.5, 2)},
        {"name": "auto", "every": "auto", "prior_mttf_s": mttf},
    ]


def emit(row: dict[str, Any], rows: list[dict[str, Any]], out: str | None) -> None:
    import torch

    row = {**row, "python": platform.python_version(), "torch": torch.__version__,
           "machine": f"{platform.machine()} {platform.node()}",
           "command": " ".join(sys.argv)}
    rows.append(row)
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")


def _med(values: list[float]) -> str:
    return f"{statistics.median(values):.2f}" if values else "-"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    med = statistics.median(values)
    return f"{med:.1%} ({min(values):.1%}–{max(values):.1%})"


def _pick(rows: list[dict[str, Any]], key: str) -> list[Any]:
    return [r[key] for r in rows if r.get(key) is not None]


def pooled(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """δ and R over every run: the median steady save, the median launch to training plus
    the median extra of an incarnation's first save."""
    delta = statistics.median(_pick([r for r in rows if r.get("steady_saves")], "delta_s"))
    restart = statistics.median(_pick([r for r in rows if r.get("section") == "run"],
                                      "restart_s"))
    return delta, restart + statistics.median(_pick(rows, "first_save_extra_s"))


def report(rows: list[dict[str, Any]]) -> None:
    runs = [r for r in rows if r.get("section") == "run"]
    delta, restart = pooled(rows)
    mttf = runs[0]["mttf_s"]
    print(f"\npooled: δ {delta:.2f} s, R {restart:.2f} s, M {mttf:g} s")
    print("| config | every (s) | seeds | failures | measured goodput, median (min–max) | "
          "predicted, exponential | predicted, first order |")
    print("|---|---|---|---|---|---|---|")
    for name in dict.fromkeys(r["config"] for r in runs):
        mine = [r for r in runs if r["config"] == name]
        every = (statistics.median(float(r["every"]) for r in mine) if name != "auto"
                 else statistics.median(i for r in mine for i in r["auto_intervals"][-2:]))
        p = predict(every, delta, restart, mttf)
        print(f"| {name} | {every:.1f} | {len(mine)} | {sum(_pick(mine, 'failures'))} | "
              f"{_spread(_pick(mine, 'goodput'))} | {p['predicted_exponential']:.1%} | "
              f"{p['predicted_first_order']:.1%} |")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Measured goodput per run (points) and the model's prediction (crosses) per config."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r.get("section") == "run"]
    names = list(dict.fromkeys(r["config"] for r in runs))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, name in enumerate(names):
        mine = [r for r in runs if r["config"] == name]
        ax.scatter([i - 0.1] * len(mine), _pick(mine, "goodput"), color="tab:blue",
                   label="measured (one run)" if i == 0 else None)
        pred = _pick(mine, "predicted_exponential")
        ax.scatter([i + 0.1] * len(pred), pred, marker="x", color="tab:orange",
                   label="model (exponential), the run's own δ, R" if i == 0 else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1)
    ax.set_title("Goodput under injected failures (2 gloo ranks, this machine)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    src = sys.argv[1]
    with open(src) as f:
        loaded = [json.loads(line) for line in f if line.strip()]
    report(loaded)
    if len(sys.argv) > 2:
        plot(loaded, sys.argv[2])
