"""Your own transformer block in jaxpar: a parallel-residual block (GPT-J, PaLM: attention and MLP
read the same normed input and are added to the residual together), registered by name, trained
with pipeline (1F1B), tensor and data parallelism with ZeRO-1 on (data, stage, model) = (2, 2, 2),
and checked against the same run on one device.

    python examples/custom_block.py

The block uses jaxpar's `Attention` and `MLP` (which carry the tensor-parallel marks) and
`param`-style logical names through them, so the pipeline stacks it into stages, tensor
parallelism splits its heads and MLP width, and ZeRO shards its parameters with no other change.
"""

import jax
from flax import nnx

from jaxpar.model import register_block
from jaxpar.model.layers import MLP, Attention, norm
from jaxpar.sharding import enter_tp


@register_block("parallel")
class ParallelBlock(nnx.Module):
    """x + attn(norm(x)) + mlp(norm(x)): one norm, and the two sub-layers side by side."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.norm = norm(cfg)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x_BxTxD: jax.Array) -> jax.Array:
        h_BxTxD = enter_tp(self.norm(x_BxTxD))  # the whole sequence for both tensor-parallel sub-layers
        return x_BxTxD + self.attn(h_BxTxD) + self.mlp(h_BxTxD)


def config(mesh=(2, 2, 2)):
    import jaxpar

    d, p, t = mesh
    return jaxpar.load_config(None, [
        "model.block=parallel", "model.n_layers=4", "model.d_model=64", "model.n_heads=4", "model.n_kv_heads=2",
        "model.d_ff=128", "model.vocab_size=64", "model.seq_len=32",
        f"mesh.data={d}", f"mesh.stage={p}", f"mesh.model={t}",
        "parallel.zero=1", "parallel.schedule=1f1b", f"parallel.microbatches={max(p, 1) * 2}",
        "train.steps=20", "train.global_batch=16", "train.log_every=1", "train.warmup_steps=2",
        f"train.run_dir=runs/custom_block_{d}x{p}x{t}"])


if __name__ == "__main__":
    import numpy as np

    import jaxpar

    jaxpar.mesh.use_cpu_devices(8)  # 8 simulated CPU devices, threads for their collectives; before JAX starts
    parallel = [r["loss"] for r in jaxpar.train(config((2, 2, 2)))]
    one = jaxpar.mesh.make_mesh(config((1, 1, 1)), jax.devices()[:1])
    single = [r["loss"] for r in jaxpar.train(config((1, 1, 1)).replace(parallel={"microbatches": 1}), mesh=one)]
    print(f"parallel block, (2, 2, 2) 1F1B + TP + ZeRO-1: loss {parallel[0]:.4f} -> {parallel[-1]:.4f}")
    print(f"max |loss difference| against one device over {len(single)} steps: "
          f"{np.max(np.abs(np.array(parallel) - np.array(single))):.2e}")
