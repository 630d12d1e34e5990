"""Chat data: `data prepare --chat` renders conversations with the folder's chat template and
masks the loss to the assistant turns; the training loss is the mean over the learned tokens, the
same on every mesh."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxpar import model
from jaxpar.config import from_dict
from jaxpar.data import DataError, prepare, read_meta
from jaxpar.data.__main__ import main as data_main
from jaxpar.mesh import make_mesh
from jaxpar.train.data import batch_at, make_eval_source, make_source
from jaxpar.train.step import build

# A ChatML-style template, as Qwen's tokenizer_config.json ships one (trim_blocks eats the
# newline after each tag, so every turn is "<|im_start|>role\ncontent<|im_end|>\n").
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "system", "user", "assistant"] + \
        [f"w{k}" for k in range(57)]  # 64 ids


def _tokenizer(folder, template=TEMPLATE):
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: k for k, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"eos_token": "<|endoftext|>"} | ({"chat_template": template} if template else {})
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(folder)


def _conversation(rng):
    words = lambda n: " ".join(f"w{k}" for k in rng.integers(0, 57, n))  # noqa: E731
    return {"messages": [{"role": "system", "content": words(3)}, {"role": "user", "content": words(4)},
                         {"role": "assistant", "content": words(5)}, {"role": "user", "content": words(2)},
                         {"role": "assistant", "content": words(3)}]}


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    tok = _tokenizer(root / "tok")
    rng = np.random.default_rng(0)
    records = [_conversation(rng) for _ in range(60)]
    with open(root / "chats.jsonl", "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    meta = prepare([str(root / "chats.jsonl")], str(root / "data"), tokenizer=tok, val_fraction=0.2, chat=True)
    return str(root / "data"), meta, records


def test_the_mask_covers_exactly_the_assistant_turns(chat_data):
    """Each conversation's learned tokens are its assistant replies and the <|im_end|> closing
    each; system, user, role headers and the document separator are context."""
    directory, meta, records = chat_data
    assert read_meta(directory) == meta
    ids = np.concatenate([np.fromfile(os.path.join(directory, meta[s]["file"]), meta["dtype"]) for s in ("train",)])
    mask = np.fromfile(os.path.join(directory, meta["train"]["mask_file"]), np.uint8)
    assert len(mask) == len(ids) == meta["train"]["n_tokens"] and mask.sum() == meta["train"]["n_learned"]
    # Conversations are whole (one chunk each) and end in the separator: split them back.
    ends = np.flatnonzero(ids == WORDS.index("<|endoftext|>"))
    conversations = np.split(np.arange(len(ids)), ends + 1)[:-1]
    n_train = len(conversations)
    assert n_train + meta["val"]["n_chunks"] == len(records) and meta["n_documents"] == len(records)
    for span in conversations:
        learned = [WORDS[i] for i in ids[span][mask[span] == 1]]
        # Which record this is: the first user turn's words are unique enough at random.
        text = " ".join(WORDS[i] for i in ids[span])
        record = next(r for r in records if " ".join(r["messages"][1]["content"].split()) in text)
        want = []
        for m in record["messages"]:
            if m["role"] == "assistant":
                want += m["content"].split() + ["<|im_end|>"]
        assert learned == want


def _cfg(directory, mesh=(1, 1, 1), **par):
    d, s, t = mesh
    return from_dict({
        "model": {"n_layers": 4, "d_model": 32, "n_heads": 4, "n_kv_heads": 2, "d_ff": 64, "vocab_size": 64,
                  "seq_len": 16},
        "mesh": {"data": d, "stage": s, "model": t}, "data": {"source": directory},
        "parallel": {"microbatches": 2 if s > 1 else 1, **par},
        "train": {"global_batch": 8, "eval_batches": 1}})


def test_the_loss_is_the_mean_over_the_learned_tokens(chat_data):
    """On one device the step's loss and gradients are those of the masked mean cross-entropy,
    computed here directly; without the mask they would be the mean over every target."""
    directory = chat_data[0]
    cfg = _cfg(directory)
    program = build(cfg, make_mesh(cfg, jax.devices()[:1]))
    batch = batch_at(make_source(cfg), 3, 8, program.batch_sharding)
    assert (np.asarray(batch) < 0).any() and (np.asarray(batch) >= 0).any(), "the batch should mix both"
    params = program.init(jax.random.key(0)).params

    def masked_mean(p):
        x = jnp.asarray(batch)
        ids = jnp.maximum(x, ~x)
        logits = model.apply(cfg.model, p, ids[:, :-1])
        ce = -jnp.take_along_axis(jax.nn.log_softmax(logits[..., :64]), ids[:, 1:, None], -1)[..., 0]
        learned = x[:, 1:] >= 0
        return jnp.sum(jnp.where(learned, ce, 0.0)) / jnp.sum(learned)

    want_loss, want_grads = jax.value_and_grad(masked_mean)(params)
    loss, grads = program.loss_and_grads(params, batch)
    # float32: the same sums in another order (~1e-7 observed).
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mesh, par", [((2, 2, 2), {"zero": 1}), ((4, 1, 2), {"zero": 3, "microbatches": 2}),
                                       ((2, 4, 1), {"schedule": "zb_h1", "microbatches": 4})],
                         ids=["2x2x2-1f1b-zero1", "4x1x2-zero3-m2", "2x4x1-zb_h1"])
def test_the_masked_loss_is_the_same_on_every_mesh(chat_data, mesh, par):
    """Loss and gradients of the masked mean on pipelined, tensor- and data-parallel meshes with
    ZeRO and accumulation equal the single device's; the validation loss too."""
    directory = chat_data[0]
    one = _cfg(directory)
    ref = build(one, make_mesh(one, jax.devices()[:1]))
    params = jax.device_get(ref.init(jax.random.key(0)).params)
    batch = np.asarray(batch_at(make_source(one), 5, 8, ref.batch_sharding))
    want_loss, want_grads = ref.loss_and_grads(params, batch)
    val = np.asarray(batch_at(make_eval_source(one), 0, 8, ref.batch_sharding))
    want_val = ref.loss_and_grads(params, val)[0]

    cfg = _cfg(directory, mesh, **par)
    program = build(cfg)
    placed = jax.device_put(params, program.state_shardings.params)
    loss, grads = program.loss_and_grads(placed, jax.device_put(batch, program.batch_sharding))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-5)  # float32 reduction order
    for g, w in zip(jax.tree.leaves(jax.device_get(grads)), jax.tree.leaves(want_grads), strict=True):
        np.testing.assert_allclose(g, np.asarray(w), rtol=2e-4, atol=1e-7)
    np.testing.assert_allclose(float(program.loss_and_grads(placed, jax.device_put(val, program.batch_sharding))[0]),
                               float(want_val), rtol=1e-5)


def test_chat_bad_input(tmp_path, capsys):
    """One `error:` line and exit 2: no chat template, a line without messages, a .txt input."""
    good = tmp_path / "c.jsonl"
    good.write_text(json.dumps(_conversation(np.random.default_rng(1))) + "\n")
    bare = _tokenizer(tmp_path / "bare", template=None)
    tok = _tokenizer(tmp_path / "tok")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "w1 w2"}) + "\n")
    txt = tmp_path / "t.txt"
    txt.write_text("w1 w2\n")
    for inputs, tokenizer, expect in [([good], bare, "has no `chat_template`"),
                                      ([bad], tok, "line 1 has no list `messages`"),
                                      ([txt], tok, "is not one; give only .jsonl files")]:
        capsys.readouterr()
        out = tmp_path / "out"
        assert data_main(["prepare", "--chat", "--input", *map(str, inputs), "--out", str(out),
                          "--tokenizer", tokenizer]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and expect in err and "\n" not in err, err
        assert not out.exists()
    with pytest.raises(DataError, match="no assistant message"):
        only_user = tmp_path / "u.jsonl"
        only_user.write_text(json.dumps({"messages": [{"role": "user", "content": "w1"}]}) + "\n")
        prepare([str(only_user)], str(tmp_path / "o2"), tokenizer=tok, chat=True)
