"""jaxpar against transformers, family by family: how far the logits, the loss and the gradients are.

For each Hugging Face family jaxpar imports (tests/test_hf.py's tiny random models: 2 layers,
hidden 64, 4 heads, 2 kv heads, vocabulary 100, every weight random), saves the model with
`save_pretrained`, loads it with `jaxpar.hf` on one device and on the (2, 2, 2) training mesh
(pipeline, tensor and data parallel), and prints the largest absolute logit difference, the
relative loss difference and the largest relative gradient difference (per leaf, Frobenius) from
transformers' float32 eager forward and backward on the same 4 sequences of 16 tokens.

Writes `results/hf_parity.json` and `.md`. Needs torch and transformers (the test extra).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
sys.path.insert(0, str(HERE.parent / "tests"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(RESULTS / "hf_parity.json"), help="JSON output (.md next to it)")
    args = p.parse_args(argv)

    from jaxpar.mesh import use_cpu_devices
    use_cpu_devices(8)
    import jax
    import numpy as np
    import torch
    import transformers

    import test_hf as T
    from jaxpar import hf, model
    from jaxpar.mesh import make_mesh
    from jaxpar.train.step import build

    batch = np.random.default_rng(7).integers(0, T.VOCAB, (T.BATCH, T.SEQ + 1))
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in T.FAMILIES:
            folder = f"{root}/{family}"
            T._hf_model(family).save_pretrained(folder)
            m = T._torch_model(folder)
            ids = torch.tensor(batch)
            logits = m(ids[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, T.VOCAB), ids[:, 1:].reshape(-1))
            loss.backward()
            want = hf.from_tensors(hf.config_from_hf(folder, seq_len=T.SEQ),
                                   {n: q.grad.numpy() for n, q in m.named_parameters()})
            for mesh_name, mesh in T.MESHES.items():
                cfg = T._cfg(folder, mesh)
                program = build(cfg, make_mesh(cfg, jax.devices()[:int(np.prod(mesh))]))
                params = hf.load_params(folder, cfg, program.state_shardings.params)
                ours = np.asarray(jax.jit(lambda q, t: model.apply(cfg.model, q, t))(params, batch[:, :-1]))
                our_loss, grads = program.loss_and_grads(params, jax.device_put(batch, program.batch_sharding))
                got = jax.device_get(grads)
                rel = []
                for path, g in jax.tree_util.tree_leaves_with_path(want):
                    x = got
                    for k in path:
                        x = x[k.key]
                    if np.linalg.norm(g) > 1e-6:  # (gpt2's key bias: an exact zero, rounding noise only)
                        rel.append(float(np.linalg.norm(np.asarray(x) - g) / np.linalg.norm(g)))
                rows.append({"family": family, "mesh": mesh_name,
                             "logits_max_abs": float(np.abs(ours[..., :T.VOCAB] - logits.detach().numpy()).max()),
                             "loss_rel": abs(float(our_loss) - float(loss)) / float(loss),
                             "grad_max_rel": max(rel)})
                print(rows[-1], flush=True)
    md = ["| family | mesh | logits, max abs diff | loss, rel diff | gradients, max rel diff (per leaf) |",
          "|---|---|---:|---:|---:|"]
    md += [f"| {r['family']} | {r['mesh']} | {r['logits_max_abs']:.1e} | {r['loss_rel']:.1e} | {r['grad_max_rel']:.1e} |"
           for r in rows]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"transformers": transformers.__version__, "torch": torch.__version__,
                               "jax": jax.__version__, "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
