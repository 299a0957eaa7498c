"""Attention shapes of real video DiTs, ordered small to large.

Each shape is (batch, heads, seq_q, seq_k, head_dim) plus, where the model passes one, a key-padding
mask: the number of trailing keys that are padding.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Shape:
    name: str
    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    padded_keys: int = 0  # trailing keys masked out (boolean key-padding mask), 0 for none
    note: str = ""

    @property
    def flops(self) -> float:
        """4 * B * H * Sq * Sk * D: the two GEMMs of non-causal attention."""
        return 4.0 * self.batch * self.heads * self.seq_q * self.seq_k * self.head_dim


SHAPES = {
    s.name: s
    for s in [
        Shape("wan_cross_480p", 1, 12, 32760, 512, 128, note="Wan2.1 cross-attention to 512 text tokens"),
        Shape("cogvideox_d64", 2, 48, 17776, 17776, 64, note="CogVideoX-like, head dim 64, CFG batch 2"),
        Shape("wan13b_480p", 1, 12, 32760, 32760, 128, note="Wan2.1-1.3B 480x832, 81 frames"),
        Shape("hunyuan_720p", 1, 24, 119056, 119056, 128, padded_keys=226,
              note="HunyuanVideo 720x1280, 129 frames: 118800 video + 256 text tokens, 226 of them padding"),
        Shape("wan14b_cross_720p", 1, 40, 75600, 512, 128, note="Wan2.1-14B cross-attention to 512 text tokens"),
        Shape("wan14b_720p", 1, 40, 75600, 75600, 128, note="Wan2.1-14B 720x1280, 81 frames"),
    ]
}

# Self-attention at growing sequence length (Wan2.1-1.3B's 12 heads of 128) for the TFLOP/s-against-
# length plot (benchmarks/plot_seqlen.py).
SWEEP = {
    s.name: s
    for s in [Shape(f"seq_{n}", 1, 12, n, n, 128, note="length sweep") for n in
              (1024, 2048, 4096, 8192, 16384, 32760, 75600)]
}

# Queries of Wan2.1 self-attention attending to growing numbers of keys (cross-attention to text
# has 512): where fsattn's fixed cost per query row stops paying (FSAttnConfig.sdpa_below_keys).
KEYS_SWEEP = {
    s.name: s
    for s in [Shape(f"{model}_keys_{n}", 1, heads, seq_q, n, 128, note="key-count sweep")
              for model, heads, seq_q in (("wan14b", 40, 75600), ("wan13b", 12, 32760))
              for n in (512, 1024, 2048, 4096, 8192)]
}
