"""Weight updates from disk (SGLang's ``/update_weights_from_disk`` and
``Engine.update_weights_from_disk``): new weights serve at once and never reuse KV computed
by the old ones; a checkpoint of another shape is refused and the old weights keep
serving; running requests finish first, or are aborted with SGLang's finish reason."""

from __future__ import annotations

import json
import shutil
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from radixlm.runtime.entrypoints.server_process import ServerProcess
from radixlm.runtime.managers.scheduler.scheduler_intake import ABORT_RUNNING

PROMPT = "Once upon a time there was a little"
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "temperature": 0, "ignore_eos": True}


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _edit_weights(path: Path, edit) -> None:
    weights = load_file(str(path / "model.safetensors"))
    edit(weights)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def new_ckpt(tmp_path_factory, tiny_llama_dir) -> Path:
    """The tiny model with every projection and embedding perturbed by noise of its own
    scale: the same shapes, other outputs."""
    out = _copy(tiny_llama_dir, tmp_path_factory.mktemp("ckpt") / "perturbed")
    gen = torch.Generator().manual_seed(1)

    def perturb(w: dict) -> None:
        for name, t in w.items():
            if t.std() > 0:
                w[name] = (t + torch.randn(t.shape, generator=gen) * t.std()).contiguous()

    _edit_weights(out, perturb)
    return out


@pytest.fixture(scope="module")
def bad_ckpts(tmp_path_factory, tiny_llama_dir) -> dict[str, tuple[Path, str]]:
    """name -> (checkpoint of another shape, what the refusal must name)."""
    root = tmp_path_factory.mktemp("bad")
    hidden = _copy(tiny_llama_dir, root / "hidden")
    config = json.loads((hidden / "config.json").read_text())
    (hidden / "config.json").write_text(json.dumps({**config, "hidden_size": 64}))
    layers = _copy(tiny_llama_dir, root / "layers")
    (layers / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    missing = _copy(tiny_llama_dir, root / "missing")
    _edit_weights(missing, lambda w: w.pop("model.layers.1.mlp.up_proj.weight"))
    vocab = _copy(tiny_llama_dir, root / "vocab")
    _edit_weights(vocab, lambda w: w.update({"lm_head.weight": w["lm_head.weight"][:1000]}))
    return {"hidden": (hidden, "hidden_size"), "layers": (layers, "num_layers"),
            "missing": (missing, "model.layers.1.mlp.up_proj.weight"),
            "vocab": (vocab, "lm_head.weight"),
            "nonexistent": (root / "nowhere", "not a directory")}


def _transformers_greedy(path: Path, ids: list[int], n: int = NEW) -> list[int]:
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    seq = list(ids)
    with torch.no_grad():
        for _ in range(n):  # ignore_eos: plain argmax steps
            seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(ids):]


# --- Engine ---------------------------------------------------------------------------------
def test_engine_update_serves_new_weights_without_cached_kv(make_engine, new_ckpt,
                                                             tiny_llama_dir):
    eng = make_engine()
    ids = eng.tokenizer.encode(PROMPT, add_special_tokens=False)
    before = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert before["output_ids"] == _transformers_greedy(tiny_llama_dir, ids)
    assert before["meta_info"]["weight_version"] == "default"
    warm = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert warm["meta_info"]["cached_tokens"] > 0  # the prompt is in the tree
    ok, message, paused = eng.update_weights_from_disk(str(new_ckpt), weight_version="v2")
    assert ok and paused == 0, message
    assert "v2" in message
    after = eng.generate(input_ids=ids, sampling_params=GREEDY)
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_version"] == "v2"
    expected = _transformers_greedy(new_ckpt, ids)
    assert after["output_ids"] == expected != before["output_ids"]
    info = eng.get_server_info()
    assert info["weight_version"] == "v2" and info["model_path"] == str(new_ckpt)
    eng.check_invariants()


@pytest.mark.parametrize("case", ["hidden", "layers", "missing", "vocab", "nonexistent"])
def test_engine_refuses_another_shape_and_keeps_serving(make_engine, bad_ckpts, case):
    eng = make_engine()
    before = eng.generate(PROMPT, GREEDY)
    path, needle = bad_ckpts[case]
    ok, message, _ = eng.update_weights_from_disk(path, weight_version="bad")
    assert not ok and needle in message, message
    again = eng.generate(PROMPT, GREEDY)
    assert again["output_ids"] == before["output_ids"]
    assert again["meta_info"]["cached_tokens"] > 0  # nothing was flushed
    assert eng.get_server_info()["weight_version"] == "default"


def test_engine_refuses_unsupported_options(make_engine, new_ckpt):
    eng = make_engine()
    for kw, field in [({"load_format": "pt"}, "load_format"), ({"keep_pause": True}, "keep_pause"),
                      ({"flush_cache": False}, "flush_cache"), ({"is_async": True}, "is_async"),
                      ({"abort_all_requests": 1}, "abort_all_requests")]:
        with pytest.raises(ValueError, match=field):
            eng.update_weights_from_disk(new_ckpt, **kw)
    assert eng.get_server_info()["weight_version"] == "default"


def _generate_in_thread(eng, params: dict, rid: str) -> tuple[threading.Thread, dict]:
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(out=eng.generate(PROMPT, params,
                                                                       rid=rid)))
    t.start()
    while eng.get_server_info()["num_running_reqs"] == 0 and t.is_alive():
        time.sleep(0.001)
    return t, result


def test_engine_abort_all_requests(make_engine, new_ckpt):
    eng = make_engine()
    t, result = _generate_in_thread(eng, LONG, "long")
    ok, message, _ = eng.update_weights_from_disk(new_ckpt, abort_all_requests=True,
                                                  weight_version="v2")
    t.join(timeout=120)
    assert ok, message
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"] == ABORT_RUNNING
    assert meta["completion_tokens"] < LONG["max_new_tokens"]
    assert meta["weight_version"] == "default"  # its tokens came from the old weights


def test_engine_running_request_finishes_on_old_weights_first(make_engine, new_ckpt):
    eng = make_engine()
    params = {**GREEDY, "max_new_tokens": 48}
    expected = eng.generate(PROMPT, params)["output_ids"]
    eng.flush_cache()
    t, result = _generate_in_thread(eng, params, "finishes")
    ok, message, _ = eng.update_weights_from_disk(new_ckpt, weight_version="v2")
    t.join(timeout=120)
    assert ok, message
    out = result["out"]
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    assert out["output_ids"] == expected  # all of it from the old weights
    assert out["meta_info"]["weight_version"] == "default"
    assert eng.generate(PROMPT, params)["meta_info"]["cached_tokens"] == 0


# --- server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    flags = ["--max-total-tokens", "8192", "--random-seed", "0", "--log-level", "warning",
             "--cpu-threads", "1"]
    srv = ServerProcess(flags, tmp_path_factory.mktemp("server") / "server.log")
    srv.wait_healthy()
    yield srv
    assert srv.stop() == 0, srv.log()


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def _update(server, path: Path, **kw) -> httpx.Response:
    return _post(server, "/update_weights_from_disk", {"model_path": str(path), **kw})


def test_server_update_refusal_and_abort(server, new_ckpt, bad_ckpts, tiny_llama_dir):
    ids = httpx.post(server.url + "/tokenize", json={"text": PROMPT}).json()["tokens"]
    before = _post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert before["output_ids"] == _transformers_greedy(tiny_llama_dir, ids)
    # another shape: 400 in SGLang's shape, the old weights keep serving
    resp = _update(server, bad_ckpts["hidden"][0], weight_version="bad")
    assert resp.status_code == 400
    body = resp.json()
    assert set(body) == {"success", "message", "num_paused_requests"}
    assert body["success"] is False and "hidden_size" in body["message"]
    same = _post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert same["output_ids"] == before["output_ids"]
    assert same["meta_info"]["cached_tokens"] > 0
    bad = _update(server, new_ckpt, load_format="dummy")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "load_format"
    # a long request is aborted with SGLang's finish reason, then the new weights serve
    long: dict = {}
    t = threading.Thread(target=lambda: long.update(out=_post(
        server, "/generate", {"input_ids": ids, "sampling_params": LONG}).json()))
    t.start()
    while httpx.get(server.url + "/server_info").json()["num_running_reqs"] == 0:
        time.sleep(0.01)
    resp = _update(server, new_ckpt, abort_all_requests=True, weight_version="v2")
    t.join(timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["success"] is True and resp.json()["num_paused_requests"] == 0
    assert long["out"]["meta_info"]["finish_reason"] == ABORT_RUNNING
    assert long["out"]["meta_info"]["weight_version"] == "default"
    after = _post(server, "/generate", {"input_ids": ids, "sampling_params": GREEDY}).json()
    assert after["meta_info"]["cached_tokens"] == 0
    assert after["meta_info"]["weight_version"] == "v2"
    assert after["output_ids"] == _transformers_greedy(new_ckpt, ids) != before["output_ids"]
    info = httpx.get(server.url + "/server_info").json()
    assert info["weight_version"] == "v2" and info["model_path"] == str(new_ckpt)
    assert httpx.get(server.url + "/model_info").json()["weight_version"] == "v2"


def test_server_flush_and_abort_shapes(server):
    flushed = httpx.post(server.url + "/flush_cache", timeout=30)
    assert flushed.status_code == 200 and flushed.text.startswith("Cache flushed.")
    assert httpx.get(server.url + "/flush_cache?timeout=1", timeout=30).status_code == 200
    assert httpx.post(server.url + "/flush_cache?timeout=-1").status_code == 400
    aborted = _post(server, "/abort_request", {"rid": "nobody"})
    assert aborted.status_code == 200 and aborted.content == b""
    assert _post(server, "/abort_request", {"abort_all": True}).status_code == 200
    assert _post(server, "/abort_request", {}).status_code == 400
