"""The RLHF run's figure: one panel per curve a reader checks first."""

from __future__ import annotations

from pathlib import Path

OLD_KINDS = {"step3": "ppo", "step3_eval": "ppo_eval"}  # step 3's metric kinds were "ppo..."


def plot(records: list[dict], path: Path) -> Path:
    """SFT loss, reward-model accuracy, step 3's reward (DPO: its loss), KL, entropy and gold
    reward, one panel each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def series(kind, key):
        kinds = {kind, OLD_KINDS.get(kind)}  # runs written before step 3 was renamed
        return [(r["step"], r[key]) for r in records if r.get("kind") in kinds and key in r]

    panels = [("SFT loss", [("train", series("sft", "loss"))]),
              ("reward model accuracy", [("train", series("reward", "accuracy")),
                                         ("held out", series("reward_eval", "accuracy"))]),
              ("step 3 reward", [("batch", series("step3", "reward")),
                                 ("DPO loss", series("dpo", "loss"))]),
              ("KL to reference (per sequence)", [("batch", series("step3", "kl"))]),
              ("policy entropy (per token)", [("batch", series("step3", "entropy"))]),
              ("gold reward", [("batch", series("step3", "gold")),
                               ("held out", series("step3_eval", "gold"))])]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (title, lines) in zip(axes, panels):
        for label, pts in lines:
            if pts:
                ax.plot(*zip(*pts), "o-" if len(pts) < 20 else "-", label=label, linewidth=0.9,
                        markersize=3)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if any(pts for _, pts in lines):
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
