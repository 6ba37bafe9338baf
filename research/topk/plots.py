"""Figures for the top-k study: training curve, overlap/recall/hit rates, ECHO Figs 7-9 analogs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

COLORS = {"trained": "tab:blue", "untrained": "tab:gray"}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_training(record: dict, path: str | Path) -> Path:
    plt = _plt()
    curve = record["curve"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    steps = [c["step"] for c in curve]
    ax1.plot(steps, [c["lm_loss"] for c in curve], label="train LM loss", color="tab:blue")
    for mode, marker in (("dense", "o"), ("sparse", "s")):
        ev = [e for e in record.get("evals", []) if e["mode"] == mode]
        ax1.plot(
            [e["step"] for e in ev],
            [e["lm_loss"] for e in ev],
            marker,
            label=f"held-out LM, {mode} attention",
            ms=4,
        )
    ax2.plot(steps, [c["kl_loss"] for c in curve], color="tab:red", label="indexer KL (train)")
    dense_steps = record.get("metrics", {}).get("dense_steps")
    for ax in (ax1, ax2):
        if dense_steps:
            ax.axvline(dense_steps, color="k", ls=":", lw=1, label="dense -> sparse")
        ax.set_xlabel("step")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    ax1.set_ylabel("nats / token (byte)")
    ax2.set_ylabel("KL (nats)")
    ax1.set_title("LM loss")
    ax2.set_title("indexer KL to the attention distribution")
    fig.suptitle(f"training: {record.get('device', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_overlap_hits(summaries: dict[str, dict], k: int, path: str | Path) -> Path:
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    tags = list(summaries)
    n_layers = len(next(iter(summaries.values()))["per_layer"])
    x = np.arange(n_layers)
    width = 0.8 / len(tags)

    def bars(ax, key, title):
        for i, tag in enumerate(tags):
            vals = [m[key] for m in summaries[tag]["per_layer"]]
            ax.bar(x + i * width, vals, width, label=tag, color=COLORS.get(tag))
        ax.set_xticks(x + width * (len(tags) - 1) / 2, [str(i) for i in x])
        ax.set_xlabel("layer")
        ax.set_ylim(0, 1)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)

    bars(axes[0, 0], "consecutive_overlap", f"consecutive-step top-{k} overlap")
    bars(axes[0, 1], "recall_of_attention_topk", f"recall of attention's top-{k} by the indexer's")

    ax = axes[1, 0]
    for tag in tags:
        per_layer = summaries[tag]["per_layer"]
        sizes = list(per_layer[0]["echo_shared_hit_rate"])
        mult = [float(s) for s in sizes]
        for m in per_layer:
            ax.plot(
                mult,
                [m["echo_shared_hit_rate"][s] for s in sizes],
                color=COLORS.get(tag),
                alpha=0.25,
            )
        mean = summaries[tag]["mean_over_layers"]["echo_shared_hit_rate"]
        ax.plot(
            mult,
            [mean[s] for s in sizes],
            "o-",
            color=COLORS.get(tag),
            label=f"{tag} (mean; thin: layers)",
        )
        hs = summaries[tag]["mean_over_layers"]["hisparse_2k_hit_rate"]
        ax.plot([2.0], [hs], "x", ms=10, color=COLORS.get(tag), label=f"{tag}: per-request 2k LRU")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("ECHO shared cache slots / (requests x k)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.set_title(
        "ECHO shared per-layer LRU cache (x: HiSparse-like per-request buffer)", fontsize=10
    )
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)

    ax = axes[1, 1]
    for i, tag in enumerate(tags):
        per_layer = summaries[tag]["per_layer"]
        echo = [m["echo_shared_hit_rate"]["2"] for m in per_layer]
        hs = [m["hisparse_2k_hit_rate"] for m in per_layer]
        ax.bar(
            x + i * width - 0.0,
            echo,
            width / 2,
            label=f"{tag}: ECHO shared, 2xRk",
            color=COLORS.get(tag),
        )
        ax.bar(
            x + i * width + width / 2,
            hs,
            width / 2,
            label=f"{tag}: per-request 2k",
            color=COLORS.get(tag),
            alpha=0.45,
            hatch="//",
        )
    ax.set_xticks(x + width * (len(tags) - 1) / 2, [str(i) for i in x])
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1)
    ax.set_title("hit rate per layer at equal memory (2k slots per request)", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)


def plot_threshold(models: dict[str, dict], meta: dict, path: str | Path) -> Path:
    """Rows: models. Columns: Fig 7 (k-th score vs EMA), Fig 8 (keys above theta / k),
    Fig 9 (threshold-bin size with and without the offset)."""
    plt = _plt()
    tags = list(models)
    k = meta["index_topk"]
    fig, axes = plt.subplots(len(tags), 3, figsize=(14, 3.6 * len(tags)), squeeze=False)
    for row, tag in enumerate(tags):
        arr = models[tag]
        layer = arr["kth"].shape[0] // 2
        ax = axes[row, 0]
        ax.plot(arr["kth"][layer, :, 0], label="exact k-th score", color="k", lw=1)
        ax.plot(
            arr["theta"][layer, :, 0], label="EMA prediction (alpha 0.5)", color="tab:orange", lw=1
        )
        ax.set_title(
            f"{tag}: layer {layer}, request 0 ({meta['prompt_lens'][0]}-token prompt)", fontsize=9
        )
        ax.set_xlabel("decode step")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)

        ax = axes[row, 1]
        ratio = arr["n_above"].ravel() / k
        low = max(float(ratio[ratio > 0].min(initial=1.0)), 1e-3) / 1.5
        bins = np.logspace(
            np.log10(low), np.log10(max(float(ratio.max(initial=1.0)), 1.0) * 1.5), 40
        )
        ax.hist(np.maximum(ratio, low), bins=bins, color=COLORS.get(tag))
        ax.axvline(1.0, color="k", ls=":", lw=1)
        ax.set_xscale("log")
        ax.set_xlabel(f"keys scoring above the EMA threshold / k (k={k})", fontsize=8)
        ax.set_title(f"{tag}: candidates above theta (all layers, steps, requests)", fontsize=9)
        ax.grid(alpha=0.3)

        ax = axes[row, 2]
        for key, ls in (("fp16", "-"), ("fp32", "--")):
            for kind, color in (("raw", "tab:red"), ("offset", "tab:green")):
                sizes = np.sort(arr[f"bin_{key}_{kind}"].ravel())
                cdf = np.arange(1, sizes.size + 1) / sizes.size
                label = f"{key} key, {'no offset' if kind == 'raw' else 'score - theta'}"
                ax.plot(np.maximum(sizes, 1), cdf, ls=ls, color=color, label=label)
        ax.set_xscale("log")
        ax.set_xlabel("keys in the threshold bin (256 bins over the top 8 key bits)", fontsize=8)
        ax.set_ylabel("CDF")
        ax.set_title(f"{tag}: threshold-bin size", fontsize=9)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return Path(path)
