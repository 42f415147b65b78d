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


def _cadence(rows: list[dict[str, Any]]) -> float:
    """The cadence the configuration kept: the median gap between two saves (save start to
    save start) over its runs."""
    gaps = _pick(rows, "save_gap_s")
    if gaps:
        return statistics.median(gaps)
    return statistics.median(float(r["every"]) for r in rows)


def paired(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per configuration: measured goodput per seed, the best fixed configuration (highest
    median) and every configuration's per-seed difference from it (common random numbers:
    within a seed all saw the same failure times)."""
    runs = [r for r in rows if r.get("section") == "run" and r.get("goodput") is not None]
    names = list(dict.fromkeys(r["config"] for r in runs))
    per = {n: {r["seed"]: r["goodput"] for r in runs if r["config"] == n} for n in names}
    seeds = sorted(set.intersection(*(set(v) for v in per.values()))) if per else []
    fixed = [n for n in names if n != "auto"]
    best = max(fixed, key=lambda n: statistics.median(per[n][s] for s in seeds))
    diffs = {n: [per[n][s] - per[best][s] for s in seeds] for n in names}
    return {"names": names, "seeds": seeds, "per": per, "best": best, "diffs": diffs}


def crn_report(rows: list[dict[str, Any]]) -> None:
    """The common-random-numbers table: medians, spread, paired differences from the best
    fixed interval, the model beside them, the machine's load."""
    from goodput_accounting import (  # type: ignore[import-not-found]
        account,
        events_of,
        steady_delta,
    )

    p = paired(rows)
    runs = [r for r in rows if r.get("section") == "run" and r["seed"] in p["seeds"]]
    steady = [d for d in (steady_delta(events_of(r["events_file"]))[0] for r in runs) if d]
    delta = statistics.median(steady)
    first = [(r, account(r, delta)) for r in runs]
    eps = statistics.median(a["measured"]["per_step"] / max(1, r["final_step"])
                            for r, a in first if a is not None)
    both = [(r, a) for r, a in ((r, account(r, delta, eps)) for r in runs) if a is not None]
    acc = [a for _, a in both]
    for r, a in both:  # for the plot
        r["predicted_model"] = a["predicted"]["useful"] / r["wall_s"]
    restart = statistics.median(a["restart_s"] for a in acc if a["restart_s"] is not None)
    extra = statistics.median(a["first_save_extra_s"] for a in acc if a["restart_s"] is not None)
    n = sum(r["failures"] + r.get("self_deaths", 0) for r in runs)
    w = sum(r["wall_s"] for r in runs)
    mttf = runs[0]["mttf_s"]
    print(f"\npooled over {len(runs)} runs: δ {delta:.2f} s (steady save), R {restart:.2f} s "
          f"(launch to training), first-save extra X {extra:.2f} s; failures {n} in {w:.0f} s "
          f"(M measured {w / n:.1f} s, injected {mttf:g} s); per-step overhead ε {eps * 1e3:.1f} ms; "
          f"best fixed: {p['best']}")
    print("| config | cadence kept (s) | measured, median (min–max) | mean | − best fixed, "
          "per seed | median | model at M (Daly) | model at the run's N, per term | "
          "measured − model | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in p["names"]:
        mine = [r for r in runs if r["config"] == name]
        every = _cadence(mine)
        step = statistics.median(_pick(runs, "step_s"))
        exp = _model_at(every, delta, restart + extra, mttf, step, eps)
        model = {r["seed"]: r["predicted_model"] for r, a in both if r["config"] == name}
        gap = [p["per"][name][s] - model[s] for s in p["seeds"] if s in model]
        d = p["diffs"][name]
        stepped = {r["seed"] for r in mine if r.get("clock_step_s", 0.0) > 1.0}
        per_seed = ", ".join(f"{x * 100:+.1f}{'†' if s in stepped else ''}"
                             for x, s in zip(d, p["seeds"], strict=True))
        vals = [p["per"][name][s] for s in p["seeds"]]
        print(f"| {name} | {every:.1f} | {_spread(vals)} | {statistics.fmean(vals):.1%} | "
              f"{per_seed} | {statistics.median(d) * 100:+.1f} | {exp:.1%} | "
              f"{_spread(list(model.values()))} | "
              f"{', '.join(f'{g * 100:+.1f}' for g in gap)} | "
              f"{_med(_pick(mine, 'load_mean'))} |")
    print("\nseconds per run, median over seeds, measured / predicted (first order at the "
          "run's own N, δ, R, X and cadence):")
    print("| config | restart | first-save extra | saves | lost work | per step | useful |")
    print("|---|---|---|---|---|---|---|")
    for name in p["names"]:
        mine = [a for r, a in both if r["config"] == name]
        cells = [f"{statistics.median(a['measured'][k] for a in mine):.1f} / "
                 f"{statistics.median(a['predicted'][k] for a in mine):.1f}"
                 for k in ("restart", "first_save_extra", "saves", "lost", "per_step", "useful")]
        print(f"| {name} | {' | '.join(cells)} |")
    _model_check(runs, p, both, delta=delta, restart=restart + extra, mttf=mttf, m_seen=w / n,
                 eps=eps)


def _model_at(every: float, delta: float, restart: float, mttf: float, step: float,
              eps: float) -> float:
    """The exponential model's goodput, less the per-step overhead ``ε`` of a timed cadence."""
    return predict(every, delta, restart, mttf)["predicted_exponential"] * step / (step + eps)


def _model_check(runs: list[dict[str, Any]], p: dict[str, Any], both: list[Any], *,
                 delta: float, restart: float, mttf: float, m_seen: float, eps: float) -> None:
    """Per configuration, the mean measured goodput against the model's at the injected
    ``M``, at the ``M`` the seeds actually drew, and at each run's own failure count."""
    step = statistics.median(_pick(runs, "step_s"))
    print(f"\nthe model against the measurement, mean over seeds (points; M injected {mttf:g} s,"
          f" drawn {m_seen:.1f} s):")
    print("| config | measured | model at injected M | measured − model | model at drawn M | "
          "measured − model | model at the run's N | measured − model |")
    print("|---|---|---|---|---|---|---|---|")
    for name in p["names"]:
        every = _cadence([r for r in runs if r["config"] == name])
        got = statistics.fmean(p["per"][name][s] for s in p["seeds"])
        at = [_model_at(every, delta, restart, m, step, eps) for m in (mttf, m_seen)]
        own = [r["predicted_model"] for r, _ in both if r["config"] == name]
        cells = [*at, statistics.fmean(own)] if own else at
        print(f"| {name} | {got:.1%} | " + " | ".join(
            f"{c:.1%} | {100 * (got - c):+.1f}" for c in cells) + " |")


#: two-sided 95 % quantiles of Student's t, by degrees of freedom (beyond 30: the normal's)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
         2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064,
         2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def paired_summary(rows: list[dict[str, Any]], name: str = "auto",
                   against: str = "fixed-young") -> dict[str, Any] | None:
    """``name`` − ``against`` per seed (points), with their median, mean, standard deviation
    and the 95 % t-interval of the mean; None with fewer than two paired seeds."""
    runs = [r for r in rows if r.get("section") == "run" and r.get("goodput") is not None]
    a = {r["seed"]: r["goodput"] for r in runs if r["config"] == name}
    b = {r["seed"]: r["goodput"] for r in runs if r["config"] == against}
    seeds = sorted(set(a) & set(b))
    if len(seeds) < 2:
        return None
    d = [100 * (a[s] - b[s]) for s in seeds]
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    half = _T975[min(len(d) - 2, len(_T975) - 1)] * sd / math.sqrt(len(d))
    loads = _pick([r for r in runs if r["seed"] in seeds], "load_mean")
    return {"seeds": seeds, "diffs": d, "median": statistics.median(d), "mean": mean,
            "sd": sd, "ci95": (mean - half, mean + half),
            "load_median": statistics.median(loads) if loads else None,
            "load_range": (min(loads), max(loads)) if loads else None}


def print_paired(rows: list[dict[str, Any]]) -> None:
    """``auto`` against each fixed configuration the rows hold, paired by seed."""
    for against in ("fixed-young", "fixed-frequent", "fixed-rare"):
        s = paired_summary(rows, "auto", against)
        if s is None:
            continue
        ahead = sum(d > 0 for d in s["diffs"])
        print(f"\nauto − {against}, points, seeds {s['seeds'][0]}–{s['seeds'][-1]} "
              f"({len(s['seeds'])}): " + ", ".join(f"{x:+.1f}" for x in s["diffs"]))
        print(f"median {s['median']:+.1f}, mean {s['mean']:+.2f}, sd {s['sd']:.1f}, 95 % "
              f"interval of the mean {s['ci95'][0]:+.1f} to {s['ci95'][1]:+.1f}; auto ahead in "
              f"{ahead} of {len(s['diffs'])}; load (1-min, per run) median "
              f"{s['load_median']:.1f}, {s['load_range'][0]:.1f}–{s['load_range'][1]:.1f}")


def plot(rows: list[dict[str, Any]], path: str) -> None:
    """Measured goodput per run, one line per seed across the configurations (common random
    numbers: a seed's runs saw the same failures), and the model's prediction (crosses)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in rows if r.get("section") == "run" and r.get("goodput") is not None]
    names = list(dict.fromkeys(r["config"] for r in runs))
    names = sorted(names, key=lambda n: ("auto" in n, _cadence([r for r in runs
                                                               if r["config"] == n])))
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    first = min(r["seed"] for r in runs)
    for seed in sorted({r["seed"] for r in runs}):
        mine = {r["config"]: r["goodput"] for r in runs if r["seed"] == seed}
        xs = [i for i, n in enumerate(names) if n in mine]
        ax.plot(xs, [mine[names[i]] for i in xs], marker="o", color="tab:blue", alpha=0.35,
                label="measured, one line per seed" if seed == first else None)
    for i, name in enumerate(names):
        med = statistics.median(_pick([r for r in runs if r["config"] == name], "goodput"))
        ax.scatter([i], [med], marker="_", s=900, color="tab:blue",
                   label="measured, median" if i == 0 else None)
        pred = _pick([r for r in runs if r["config"] == name], "predicted_model")
        ax.scatter([i + 0.12] * len(pred), pred, marker="x", color="tab:orange",
                   label="model at the run's own N, δ, R, X" if i == 0 else None)
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("goodput")
    ax.set_ylim(0, 1)
    ax.set_title("Goodput under injected failures (2 gloo ranks, common random numbers)")
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    src = sys.argv[1]
    with open(src) as f:
        loaded = [json.loads(line) for line in f if line.strip()]
    if any("launch_wall" in r for r in loaded):
        crn_report([r for r in loaded if "launch_wall" in r])
    else:
        report(loaded)
    if len(sys.argv) > 2:
        plot(loaded, sys.argv[2])
