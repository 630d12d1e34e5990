"""`python -m jaxpar.plan --evaluate` (the config's own layout, costed by `jaxpar.plan.estimate`
whether or not the search would prune it), `--json` listing every layout it estimated, and the
planner's messages: the memory parts of a layout that fits nowhere, the hardware in the header.
The planner compiles nothing: a tiny model on 2 devices keeps each search to seconds."""

import dataclasses
import json
import os
import re

import pytest
import yaml

from jaxpar.config import load_config
from jaxpar.costs import Roofline
from jaxpar.plan import _human, estimate, main, plan
from jaxpar.plan_presets import HARDWARE

TINY = {"model": {"arch": "llama", "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2, "d_ff": 128,
                  "vocab_size": 128, "seq_len": 32},
        "train": {"global_batch": 8}}
DEVICES = 2
CPU = ["--platform", "cpu"]


def write(tmp_path, name="run.yaml", mesh=None, **parallel):
    """A config file of TINY with a mesh and parallel settings."""
    body = {**TINY, "mesh": mesh or {"data": -1}, "parallel": parallel}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return str(path)


def run(capsys, *argv):
    code = main([*map(str, argv)])
    out = capsys.readouterr()
    return code, out.out, out.err


def key(row):
    """What names a layout in a JSON row."""
    return json.dumps([row["mesh"], row["parallel"], row["master_weights"]], sort_keys=True)


def roof(devices=DEVICES, memory=None):
    hw = HARDWARE["h100-80gb"]
    return Roofline(hw if memory is None else dataclasses.replace(hw, memory_bytes=memory), None, devices, False)


def expected(path, shape, memory=None):
    """`jaxpar.plan.estimate` of the layout at `path` on `shape`, as a JSON row."""
    cfg = load_config(path)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, **dict(zip(("data", "stage", "model"), shape))))
    return estimate(cfg, shape, roof(memory=memory), "cpu").to_dict()


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    """The search's JSON over TINY on 2 devices (3 MB per device: some layouts do not fit), and the
    table's search (`keep`, as the table runs it with --top 3) of the same."""
    import contextlib
    import io

    path = write(tmp_path_factory.mktemp("search"))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["--config", path, "--devices", str(DEVICES), *CPU, "--json", "--device-memory", "3MB"]) == 0
    table = plan(load_config(path), DEVICES, roof(memory=3 * 10**6), "cpu", keep=3)
    return json.loads(buf.getvalue()), table


def test_evaluate_equals_estimate_and_the_searchs_row(tmp_path, capsys, search):
    rows, _ = search
    path = write(tmp_path, mesh={"data": 1, "stage": 1, "model": 2}, sequence_parallel=True, microbatches=2,
                 remat="dots")
    code, out, err = run(capsys, "--config", path, "--evaluate", "--json", *CPU, "--device-memory", "3MB")
    assert code == 0 and err == ""
    row = json.loads(out)
    assert row == expected(path, (1, 1, 2), memory=3 * 10**6)
    assert row["rank"] is None  # evaluated alone
    # The search ranks this layout: its row carries the same figures.
    found = [r for r in rows["layouts"] if key(r) == key(row)]
    assert len(found) == 1 and found[0]["fits"] and isinstance(found[0]["rank"], int)
    assert {**found[0], "rank": None} == row
    # The text: memory parts, bytes per axis, step-time parts, from the same figures.
    code, out, _ = run(capsys, "--config", path, "--evaluate", *CPU, "--device-memory", "3MB")
    mem = row["memory_bytes"]
    assert code == 0 and "layout  (data, stage, model) = (1, 1, 2), ZeRO-0, 2 microbatches, remat dots, SP" in out
    assert (f"memory  {_human(mem['total'])} per device of 3.0 MB: fits" in out
            and f"parameters {_human(mem['params'])}, gradients {_human(mem['gradients'])}, optimizer state "
                f"{_human(mem['optimizer'])}" in out)
    assert f"model {_human(row['bytes_per_step']['model'])}" in out
    assert f"time    {row['step_time_s']:.3g} s per step: compute {row['step_time_parts_s']['compute']:.3g} s" in out


def test_a_layout_the_search_prunes_is_still_evaluated(tmp_path, capsys, search):
    rows, table = search
    # A layout the table's search (--top 3) skipped as slower in compute alone, as a config.
    estimated = {key(e.to_dict()) for e in table.ranked + table.too_big}
    pruned = next(r for r in rows["layouts"] if key(r) not in estimated and r["mesh"]["stage"] > 1)
    path = write(tmp_path, mesh=pruned["mesh"], **pruned["parallel"])
    code, out, _ = run(capsys, "--config", path, "--evaluate", "--json", *CPU, "--device-memory", "3MB")
    assert code == 0
    row = json.loads(out)
    assert key(row) == key(pruned) and table.pruned["slower"] > 0
    assert row == expected(path, (1, 2, 1), memory=3 * 10**6) == {**pruned, "rank": None}
    # A policy the search does not enumerate, and a mesh whose -1 is filled from --devices.
    path = write(tmp_path, "b.yaml", remat="dots_except_mlp")
    code, out, _ = run(capsys, "--config", path, "--evaluate", "--json", "--devices", 2, *CPU, "--device-memory", "3MB")
    assert code == 0 and json.loads(out) == expected(path, (2, 1, 1), memory=3 * 10**6)


def test_json_lists_every_estimated_layout_with_fits_and_rank(search):
    rows, table = search
    layouts = rows["layouts"]
    # Layouts the table's search skipped as slower are listed, with their figures.
    listed = {key(r) for r in layouts}
    table_keys = {key(e.to_dict()) for e in table.ranked + table.too_big}
    assert table.pruned["slower"] > 0 and len(listed - table_keys) > 0
    # Those that fit first, ranked 1, 2, ... as the table; the table's rows are the JSON's first rows.
    fits = [r for r in layouts if r["fits"]]
    assert layouts[:len(fits)] == fits and [r["rank"] for r in fits] == list(range(1, len(fits) + 1))
    assert [key(r) for r in fits[:3]] == [key(e.to_dict()) for e in table.ranked[:3]]
    assert len(fits) > len(table.ranked)
    too_big = layouts[len(fits):]
    assert too_big and all(r["rank"] is None and not r["fits"] for r in too_big)
    # What was not estimated is counted: none for being slower; those bigger than one too big.
    assert rows["not_estimated"]["slower"] == 0 and rows["not_estimated"]["bigger"] >= 0
    assert set(rows) == {"layouts", "not_estimated", "refused"}


def test_json_with_top_skips_as_the_table_does_and_counts_it(tmp_path, capsys, search):
    _, table = search
    path = write(tmp_path)
    code, out, _ = run(capsys, "--config", path, "--devices", DEVICES, *CPU, "--json", "--device-memory", "3MB",
                       "--top", 3)
    rows = json.loads(out)
    assert code == 0 and rows["not_estimated"] == table.pruned and rows["not_estimated"]["slower"] > 0
    assert [key(r) for r in rows["layouts"]] == [key(e.to_dict()) for e in table.ranked + table.too_big]


def test_fits_nowhere_names_the_parts_of_the_smallest_layouts_memory(tmp_path, capsys):
    path = write(tmp_path)
    out_file = tmp_path / "never.yaml"
    code, out, err = run(capsys, "--config", path, "--devices", DEVICES, *CPU, "--device-memory", "1MB",
                         "--write-config", out_file)
    assert code == 2 and out == "" and err.count("\n") == 1 and not out_file.exists()
    match = re.search(r"the smallest needs ([0-9.]+ [kM]?B) per device \(\(data, stage, model\) = .*\), "
                      r"[0-9.]+ [kM]?B over the 1.0 MB of a device: parameters [0-9.]+ [kM]?B \+ "
                      r"gradients [0-9.]+ [kM]?B \+ optimizer state [0-9.]+ [kM]?B \+ activations [0-9.]+ [kM]?B; "
                      r"the search tried every ZeRO stage, remat policy and microbatch count these devices allow, "
                      r"so what is left is more devices or a device with more memory \(--hardware h200-141gb or "
                      r"--device-memory\)", err)
    assert match, err


def test_header_names_the_hardware_planned_for(tmp_path, capsys):
    path = write(tmp_path)
    code, out, _ = run(capsys, "--config", path, "--devices", DEVICES, *CPU, "--top", 2)
    assert code == 0
    cluster = next(line for line in out.splitlines() if line.startswith("cluster"))
    assert cluster.startswith(f"cluster {DEVICES} simulated CPU devices (--platform cpu") and " x H100" not in cluster
    assert "costed with the figures of H100-SXM5-80GB (--hardware h100-80gb" in cluster
    code, out, _ = run(capsys, "--config", path, "--devices", DEVICES, "--evaluate", "--hardware", "a100-80gb")
    assert code == 0 and f"\ncluster {DEVICES} x A100-SXM4-80GB, 80.0 GB each" in out


def test_evaluate_of_a_layout_that_does_not_fit_names_its_parts_and_fixes(tmp_path, capsys):
    path = write(tmp_path, mesh={"data": 2})
    code, out, _ = run(capsys, "--config", path, "--evaluate", *CPU, "--device-memory", "1MB")
    assert code == 0
    match = re.search(r"\ndoes not fit: this layout needs [0-9.]+ [kM]?B per device \(\(data, stage, model\) = "
                      r"\(2, 1, 1\), ZeRO-0, 1 microbatch, remat none\), [0-9.]+ [kM]?B over the 1.0 MB of a "
                      r"device: parameters .* \+ gradients .* \+ optimizer state .* \+ activations [^;]*; "
                      r"it would shrink with ([^;]*); or drop --evaluate", out)
    assert match, out
    fixes = match.group(1)
    for fix in ("parallel.zero: 3", "parallel.remat: full", "more devices",
                "a device with more memory (--hardware h200-141gb or --device-memory)"):
        assert fix in fixes, fixes


@pytest.mark.parametrize("mesh, extra, message", [
    ({"data": 1, "model": 8}, [], r"model.n_heads = 4 is not divisible by mesh.model = 8"),
    ({"data": -1}, [], r"mesh.data = -1 takes its size from the device count, which was not given; pass it "),
    ({"data": 2}, ["--devices", "4"], r"mesh \(data, stage, model\) = \(2, 1, 1\) has 2 devices but 4"),
    ({"data": 2}, ["--write-config", "WRITTEN"], r"--write-config goes with the search, which --evaluate does not"),
])
def test_evaluate_of_a_refused_layout_is_one_line_and_exit_2(tmp_path, capsys, mesh, extra, message):
    path = write(tmp_path, mesh=mesh)
    written = tmp_path / "written.yaml"
    extra = [str(written) if a == "WRITTEN" else a for a in extra]
    code, out, err = run(capsys, "--config", path, "--evaluate", *extra)
    assert code == 2 and out == "" and err.startswith("error: ") and err.count("\n") == 1, err
    assert re.search(message, err), err
    assert not written.exists() and os.listdir(tmp_path) == ["run.yaml"]
