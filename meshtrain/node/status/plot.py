"""Loss curves to PNG, for the demo's summary and the convergence benchmark (one plotting path).

matplotlib with the Agg backend: no display needed, nothing but a file written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def plot_curves(
    curves: Mapping[str, Sequence[tuple[float, float]]],
    path: str | Path,
    *,
    title: str,
    xlabel: str = "inner step",
    ylabel: str = "held-out loss",
    beside: Mapping[str, Sequence[tuple[float, float]]] | None = None,
    beside_xlabel: str = "bytes sent per peer (log scale)",
    log_x: bool = False,
) -> Path:
    """Write one line per named curve of (x, y) points to `path` (PNG); the legend carries each
    curve's last value, and a curve of one point is drawn as a marker. With `beside`, a second
    panel to the right plots those curves against a logarithmic x axis (the benchmark: loss
    against bytes sent). `log_x`: the first panel's x axis is logarithmic too (points at x <= 0
    are left out). Returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2 if beside else 1, figsize=(16, 5.6) if beside else (9, 5.6), squeeze=False)
    try:
        panels = [(axes[0][0], curves, xlabel, log_x)]
        if beside:
            panels.append((axes[0][1], beside, beside_xlabel, True))
        for ax, lines, label, log_x in panels:
            for name, points in lines.items():
                points = [(x, y) for x, y in points if not log_x or x > 0]
                if not points:
                    continue
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, marker="o" if len(xs) == 1 else None, label=f"{name} ({ys[-1]:.3f})")
            if log_x:
                ax.set_xscale("log")
            ax.set_xlabel(label)
            ax.set_ylabel(ylabel)
            ax.set_title(title + (" — against bytes sent" if log_x else ""))
            ax.legend()
            ax.grid(alpha=0.3)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)
    return path
