"""Training curves of a run folder: reward, Match F1, accuracy and KL in one PNG."""

from __future__ import annotations

from pathlib import Path

from crystal_grpo.jsonl import read_jsonl


def _series(rows: list[dict], suffix: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the first key equal to or ending with ``suffix``."""
    xs, ys = [], []
    for r in rows:
        key = next((k for k in r if k == suffix or k.endswith("/" + suffix)), None)
        if key is not None and isinstance(r[key], (int, float)):
            xs.append(r["step"])
            ys.append(r[key])
    return xs, ys


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"{run_dir}: no such run folder")
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if "loss" in r or "reward" in r]
    val = read_jsonl(run_dir / "validation.jsonl")
    if not train and not val:
        phases = sorted(p.name for p in run_dir.iterdir() if (p / "metrics.jsonl").exists())
        hint = (f"; this is a multi-phase run: plot one of its phase folders ({', '.join(phases)})" if phases
                else " (a run writes them from its first logged step)")
        raise FileNotFoundError(f"{run_dir}: nothing to plot: no training rows in metrics.jsonl and no "
                                f"validation.jsonl{hint}")
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = [("reward", "reward", "reward"), ("Match F1", "f1", "f1"),
              ("accuracy", "accuracy", "accuracy"), ("KL", "kl", None)]
    for ax, (title, train_key, val_key) in zip(axes.flat, panels):
        ax.plot(*_series(train, train_key), label="train", lw=1.2)
        if val_key:
            xs, ys = _series(val, val_key)
            ax.plot(xs, ys, "o-", label="validation", lw=1.2)
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(run_dir.name)
    fig.tight_layout()
    out = Path(out) if out else run_dir / "training_curves.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out
