"""`envoykit serve` and `ek.connect()` with real server processes on 127.0.0.1.

One server (``tiny``, TP=2) serves the module; the last test stops it with SIGTERM. Two more
start for the faults that end an engine: a rank killed under a server (which exits), and
under one started with ``--restart`` (which restarts, and is then killed outright). Results
are compared with the in-process engine of the same model and TP size, the tuned lens among
them (translators installed through the server once, checked against its model), and SAE
features, splices and clamps (each SAE sent once, checked against the served model).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import queue
import re
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
from seeded import seeded_tuned_lens

import envoykit as ek
from envoykit.analyses.installed import InstalledSAEs
from envoykit.runtime.cleanup import mapped_segments
from envoykit.serve import tokens

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The capital of France is"
START_SECONDS = 600  # an engine start on two busy cores


class Server:
    """An `envoykit serve` process and everything its engine made, to check it is gone."""

    def __init__(self, log_dir: Path, *options: str) -> None:
        self.stderr_path = log_dir / "serve.stderr"
        # The server's temporary files (its engine's scratch directory, its fork server's
        # socket) in a directory of its own, so what a kill leaves there is plain to see;
        # short, as the sockets' paths must be.
        self.temporary = tempfile.mkdtemp(prefix="ek-serve-")
        command = [sys.executable, "-m", "envoykit.cli", "serve", "--model", "tiny", "--tp", "2"]
        self.process = subprocess.Popen(
            [*command, "--port", "0", *options],
            stdout=subprocess.PIPE,
            stderr=self.stderr_path.open("w"),
            text=True,
            cwd=ROOT,
            env={**os.environ, "TMPDIR": self.temporary},
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        try:
            line = self.lines.get(timeout=START_SECONDS)
        except queue.Empty:
            self.process.kill()
            raise AssertionError(f"no ready line: {self.stderr()[-2000:]}") from None
        found = re.search(r" at (http://\S+) \(token in (\S+);", line)
        assert found, line
        self.ready_line = line
        self.url, self.record = found[1], Path(found[2])
        self.engine_pids: list[int] = []
        self.segments: set[str] = set()
        self.scratch: set[str] = set()
        self.watch_engine()

    def watch_engine(self) -> None:
        """Note the engine's processes, the segments they map and their scratch directory."""
        engine = [p for p in self.descendants() if p.name().startswith("VLLM::")]
        self.engine_pids += [p.pid for p in engine]
        self.segments |= {f"/dev/shm/{name}" for name in mapped_segments(set(engine))}
        self.scratch |= {path for path in self.temporaries() if "envoykit-" in path}

    def temporaries(self) -> list[str]:
        """What is in the server's temporary directory, less torch's compile cache (one per
        user, made on import and shared by every later process)."""
        names = [n for n in os.listdir(self.temporary) if not n.startswith("torchinductor_")]
        return [os.path.join(self.temporary, name) for name in names]

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.put(line)

    def descendants(self) -> list[psutil.Process]:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(self.process.pid).children(recursive=True)
        return []

    def rank(self, number: int) -> psutil.Process:
        (found,) = [p for p in self.descendants() if p.name() == f"VLLM::Worker_TP{number}"]
        return found

    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def token(self) -> str:
        return tokens.find(self.url).token

    def assert_nothing_left(self, seconds: float) -> None:
        """No engine process, shared-memory segment, temporary file or token record."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.leftovers():
            time.sleep(0.25)
        left = self.leftovers()
        for pid in self.engine_pids:  # leak nothing into the rest of the run
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        assert left == [], left

    def leftovers(self) -> list:
        alive = [pid for pid in self.engine_pids if _alive(pid)]
        paths = [p for p in (*self.segments, str(self.record)) if os.path.exists(p)]
        return alive + paths + self.temporaries()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.temporary, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    served = Server(tmp_path_factory.mktemp("server"))
    yield served
    served.stop()


@pytest.fixture(scope="module")
def client(server):
    with ek.connect(server.url) as connection:
        yield connection


def assert_same_lens(a: ek.LensResult, b: ek.LensResult) -> None:
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_array_equal(a.target_ranks, b.target_ranks)
    np.testing.assert_array_equal(a.positions, b.positions)
    for name in ("top_probs", "entropy", "kl", "target_probs"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=0, atol=1e-6)
    assert (a.tokens, a.sites, a.target_labels, a.n_generated) == (
        b.tokens,
        b.sites,
        b.target_labels,
        b.n_generated,
    )
    assert {k: v for k, v in a.meta.items() if k != "returned_bytes"} == {
        k: v for k, v in b.meta.items() if k != "returned_bytes"
    }


# -- the same surface, the same results ---------------------------------------------------


def test_ready_line_and_token_file(server):
    """One line with the URL; the token in a 0600 file in a 0700 directory, never printed."""
    assert server.ready_line.startswith("envoykit serve: tiny on 2 cpu rank(s)")
    assert server.url.startswith("http://127.0.0.1:")
    assert stat.S_IMODE(server.record.stat().st_mode) == 0o600
    assert stat.S_IMODE(server.record.parent.stat().st_mode) == 0o700
    token = server.token()
    assert len(token) >= 40
    log = re.search(r"vLLM log: (\S+)\)", server.ready_line)[1]
    for text in (server.ready_line, server.stderr(), Path(log).read_text()):
        assert token not in text


def test_info_and_locations_equal_in_process(client, tiny2):
    """The same model, split and numbers; a served engine is not self-checked at load (its
    async engine answers the check's traces only on its event loop), and says so."""
    assert tiny2.info.validated == ("lens", "attribution", "sites")
    assert (client.info.validated, client.info.failed) == ((), ())
    assert client.info == dataclasses.replace(tiny2.info, validated=())
    assert client.locations() == tiny2.locations()
    assert client.tokenizer(PROMPT)["input_ids"] == tiny2.tokenizer(PROMPT)["input_ids"]


def test_lens_equals_in_process(client, tiny2):
    """Every lens argument through the server gives what the in-process engine gives."""
    cases = [
        dict(prompt=PROMPT, targets=[" Paris", 17], top_k=5),
        dict(prompt=PROMPT, layers=["embed", 1, -1], positions=[0, -1], reduce_dtype="float64"),
        dict(prompt=PROMPT, sites=("resid", "resid_mid", "attn", "mlp"), layers=[2, 3]),
        dict(prompt=PROMPT, patch=ek.Patch("The capital of Italy is", layer=2)),
        dict(prompt=[PROMPT, "Hello world", "One two three"], generate=3, top_k=3),
    ]
    for case in cases:
        remote, local = client.lens(**case), tiny2.lens(**case)
        if isinstance(remote, list):
            assert len(remote) == len(local) == 3
        for a, b in zip(np.atleast_1d(remote), np.atleast_1d(local)):
            assert_same_lens(a, b)


def test_multi_trace_requests_equal_in_process(client, tiny2):
    """Attribution, a patch sweep (batched invokes) and a comparison, through the server."""
    a, b = client.attribute(PROMPT, [5, 17]), tiny2.attribute(PROMPT, [5, 17])
    np.testing.assert_allclose(a.values, b.values, atol=1e-5)
    source, target = "The capital of France is", "The capital of Italy is"
    kwargs = dict(target_token=5, layers=[1, 3], batch=3, progress=False)
    np.testing.assert_allclose(
        client.patch_sweep(source, target, **kwargs).values,
        tiny2.patch_sweep(source, target, **kwargs).values,
        atol=1e-6,
    )
    remote = client.lens([source, target], compare=True)
    local = tiny2.lens([source, target], compare=True)
    np.testing.assert_allclose(remote.js, local.js, atol=1e-9)


def test_attention_heads_and_head_edits_equal_in_process(client, tiny2):
    """Patterns, per-head attribution, an ablation and a head patch, through the server."""
    kwargs = dict(layers=[1, -1], heads=[0, 3], queries=[-1], top_k=3)
    remote, local = client.attention(PROMPT, **kwargs), tiny2.attention(PROMPT, **kwargs)
    np.testing.assert_array_equal(remote.keys, local.keys)
    np.testing.assert_allclose(remote.weights, local.weights, atol=1e-6)
    a, b = client.attribute(PROMPT, [5], heads=True), tiny2.attribute(PROMPT, [5], heads=True)
    np.testing.assert_allclose(a.head_values, b.head_values, atol=1e-5)
    edits = [
        ek.Ablate(2, 1, kind="mean"),
        ek.Patch("The capital of Italy is", 3, site="head", head=2),
    ]
    assert_same_lens(client.lens(PROMPT, patch=edits), tiny2.lens(PROMPT, patch=edits))


def test_steering_through_the_server_equals_in_process(client, tiny2):
    """A vector built through the server, a steered generation, lens and sweep, as in process;
    a steered trace, which installs a block on the ranks, is refused with what works."""
    positive, negative = ["I love it, it is great"], ["I hate it, it is awful"]
    remote = client.steering_vector(positive, negative, 2, progress=False)
    local = tiny2.steering_vector(positive, negative, 2, progress=False)
    np.testing.assert_allclose(remote.vector, local.vector, atol=1e-5)
    assert remote.model == local.model
    steer = ek.Steer(local, 2, scale=3.0)
    generated = client.generate(PROMPT, 8, steer=steer)
    assert generated.token_ids == tiny2.generate(PROMPT, 8, steer=steer).token_ids
    assert generated.meta["steer"][0]["scale"] == 3.0
    assert_same_lens(client.lens(PROMPT, steer=steer), tiny2.lens(PROMPT, steer=steer))
    sweep = client.steer_sweep(PROMPT, steer, scales=[-1, 1], max_tokens=4, progress=False)
    assert (
        sweep.token_ids
        == tiny2.steer_sweep(PROMPT, steer, scales=[-1, 1], max_tokens=4, progress=False).token_ids
    )
    with pytest.raises(ek.InvalidRequest, match="through a server, steer with lens"):
        client.trace(PROMPT, steer=steer)
    assert client.generate_ids(PROMPT, 4) == tiny2.generate_ids(PROMPT, 4)


def test_generation_and_plain_traces_run_on_the_server(client, tiny2):
    assert client.generate_ids(PROMPT, 8) == tiny2.generate_ids(PROMPT, 8)
    assert client.generate(PROMPT, 8) == tiny2.generate(PROMPT, 8)
    results = []
    for engine in (client, tiny2):
        with engine.trace(PROMPT):
            hidden, residual = engine.model.model.layers[-1].output
            normed, _ = engine.model.model.norm(hidden.clone(), residual.clone())
            logits = engine.model.lm_head(normed).save()
            final = engine.model.logits.save()
        results.append((logits, final))
    (remote, remote_final), (local, _) = results
    assert remote.shape == (len(client.tokenizer(PROMPT)["input_ids"]), client.info.vocab)
    np.testing.assert_allclose(remote[-1], remote_final[-1], atol=1e-5)
    np.testing.assert_allclose(remote, local, atol=1e-6)


def test_explorer_on_a_connection(client, tiny2):
    """The widget runs its lens through the server and shows what it shows in-process."""
    data = []
    for engine in (client, tiny2):
        explorer = ek.LensExplorer(engine, prompt=PROMPT, targets=[" Paris"], top_k=5)
        assert explorer.run() is explorer.result
        data.append(explorer.heatmap.data)
    remote, local = data
    assert remote["vocab"] == local["vocab"] and remote["top_ids"] == local["top_ids"]
    np.testing.assert_allclose(remote["top_probs"], local["top_probs"], atol=1e-6)


# -- the tuned lens through a connection ---------------------------------------------------


@pytest.fixture(scope="module")
def tuned(tiny2):
    return seeded_tuned_lens(tiny2)


def translator_posts(client, monkeypatch, prefix="/v1/envoykit/translators/") -> list[str]:
    """The paths of the translator (or, by ``prefix``, SAE) installs the client sends from
    now on."""
    sent: list[str] = []
    request = client._request

    def spy(method: str, path: str, **kwargs):
        if method == "POST" and path.startswith(prefix):
            sent.append(path)
        return request(method, path, **kwargs)

    monkeypatch.setattr(client, "_request", spy)
    return sent


def test_tuned_lens_equals_in_process_and_is_sent_once(server, client, tiny2, tuned, monkeypatch):
    """The server checks and installs the translators once; the tuned lens through it is
    the in-process tuned lens (1e-6, as every lens here), and a second lens sends nothing."""
    sent = translator_posts(client, monkeypatch)
    cases = [
        dict(prompt=PROMPT, targets=[" Paris"], top_k=5),
        dict(prompt=[PROMPT, "Hello world"], layers=["embed", "all"], generate=2, top_k=3),
    ]
    results = []
    for case in cases:
        remote, local = client.lens(**case, translator=tuned), tiny2.lens(**case, translator=tuned)
        for a, b in zip(np.atleast_1d(remote), np.atleast_1d(local)):
            assert a.meta["lens"] == "tuned" and a.meta["translator"] == tuned.key
            assert_same_lens(a, b)
        results.append(remote)
    assert sent == [f"/v1/envoykit/translators/{tuned.key}"]  # once, for both lenses
    plain = client.lens(**cases[0])
    assert not np.allclose(plain.kl[:-1], results[0].kl[:-1])  # the translators did apply
    np.testing.assert_array_equal(plain.kl[-1], results[0].kl[-1])  # the last layer is exact
    with httpx.Client(base_url=server.url, headers={"ndif-api-key": server.token()}) as http:
        path = f"/v1/envoykit/translators/{tuned.key}"
        assert http.get(path, timeout=30).json() == {"key": tuned.key, "installed": True}
        assert http.post(path, content=tuned.to_file_bytes(), timeout=30).json() == {
            "key": tuned.key
        }
        assert http.get(path, headers={"ndif-api-key": "wrong"}).status_code == 401
        assert http.post(path, content=b"x", headers={"ndif-api-key": "wrong"}).status_code == 401


def test_tuned_lens_refusals_through_the_server(server, client, tuned):
    """Another model's translators: `InvalidRequest` naming both, as in process; a body that
    is not a tuned lens (or not the lens of its key): 400; the server serves on."""
    other = ek.TunedLens(tuned.weights, {**tuned.model, "name": "demo", "head_hash": "0" * 64})
    with pytest.raises(ek.InvalidRequest, match=r"trained on 'demo'.*not on the engine's 'tiny'"):
        client.lens(PROMPT, translator=other)
    with pytest.raises(ek.InvalidRequest, match=r"takes an ek\.TunedLens"):
        client.lens(PROMPT, translator="lens.safetensors")
    with pytest.raises(ek.InvalidRequest, match="residual stream"):
        client.lens(PROMPT, sites=["attn"], translator=tuned)
    import torch

    half = ek.TunedLens({0: tuned.weights[0]}, tuned.model)  # one layer of four
    wide = ek.TunedLens(
        {layer: (torch.zeros(8, 8), torch.zeros(8)) for layer in tuned.weights}, tuned.model
    )
    bodies = {
        "empty": (b"", "not a tuned lens"),
        "text": (b"not safetensors", "not a tuned lens"),
        "pickle": (b"\x80\x04K\x01.", "not a tuned lens"),
        "no model": (tuned.to_bytes(), "not a tuned lens"),
        "one layer": (half.to_file_bytes(), "A.0..A.3"),
        "shapes": (wide.to_file_bytes(), "not a floating-point (128, 128)"),
        "other key": (other.to_file_bytes(), f"key {other.key}, not {tuned.key[::-1]}"),
    }
    with httpx.Client(base_url=server.url, headers={"ndif-api-key": server.token()}) as http:
        for name, (body, message) in bodies.items():
            path = f"/v1/envoykit/translators/{tuned.key[::-1]}"  # a key nothing has
            response = http.post(path, content=body, timeout=30)
            assert response.status_code == 400, (name, response.text)
            assert response.json()["invalid_request"] is True
            assert message in response.json()["detail"], (name, response.text)
        path = f"/v1/envoykit/translators/{other.key}"
        response = http.post(path, content=other.to_file_bytes(), timeout=30)
        assert response.status_code == 422 and "trained on 'demo'" in response.json()["detail"]
        assert http.get(path, timeout=30).json()["installed"] is False
    assert client.lens(PROMPT, translator=tuned).meta["lens"] == "tuned"


def test_train_evaluate_check_load_and_explorer_through_the_server(client, tiny2, tmp_path):
    """`TunedLens.train`, `evaluate`, `check`, `load` and `LensExplorer(translator=...)` take
    a connection as they take an engine, and give what they give in process."""
    from envoykit.analyses.tuned import offline_texts

    texts, held_out = offline_texts()
    kwargs = dict(steps=2, batch_tokens=128, progress=False)
    remote = ek.TunedLens.train(client, texts, **kwargs)
    local = ek.TunedLens.train(tiny2, texts, **kwargs)
    assert remote.model == local.model and client.fingerprint() == tiny2.fingerprint()
    for layer, (a, b) in local.weights.items():
        np.testing.assert_allclose(remote.weights[layer][0], a, rtol=0, atol=1e-5)
        np.testing.assert_allclose(remote.weights[layer][1], b, rtol=0, atol=1e-5)
    remote.check(client)
    assert ek.TunedLens.load(remote.save(tmp_path / "tiny.safetensors"), client).key == remote.key
    text = held_out[0][:600]
    quality = {
        name: local.evaluate(engine, [text])
        for name, engine in (("remote", client), ("local", tiny2))
    }
    assert quality["remote"].tokens == quality["local"].tokens > 8
    for name in ("logit_kl", "tuned_kl"):
        np.testing.assert_allclose(
            getattr(quality["remote"], name), getattr(quality["local"], name), rtol=0, atol=1e-5
        )
    data = []
    for engine in (client, tiny2):
        explorer = ek.LensExplorer(engine, prompt=PROMPT, top_k=5, translator=local)
        explorer.lens_kind.value = "tuned"
        assert explorer.run().meta["lens"] == "tuned"
        data.append(explorer.heatmap.data)
    remote_data, local_data = data
    assert remote_data["top_ids"] == local_data["top_ids"]
    np.testing.assert_allclose(remote_data["top_probs"], local_data["top_probs"], atol=1e-6)


# -- SAEs through a connection --------------------------------------------------------------

SAE_DATA = ROOT / "tests" / "data" / "sae"
SAE_POSTS = "/v1/envoykit/saes/"


@pytest.fixture(scope="module")
def saes():
    names = ("saelens_jumprelu", "saelens_topk", "saelens_standard")
    return {name: ek.SAE.load(SAE_DATA / name) for name in names}


def assert_same_features(a: ek.FeatureResult, b: ek.FeatureResult) -> None:
    np.testing.assert_array_equal(a.top_ids, b.top_ids)
    np.testing.assert_array_equal(a.l0, b.l0)
    np.testing.assert_array_equal(a.tracked, b.tracked)
    for name in ("top_acts", "sq_error", "sq_centered", "tracked_acts"):
        np.testing.assert_allclose(getattr(a, name), getattr(b, name), rtol=1e-6, atol=1e-6)
    assert (a.tokens, a.meta) == (b.tokens, b.meta)


def test_saes_equal_in_process_and_are_sent_once(server, client, tiny2, saes, monkeypatch):
    """Features, a splice and clamps (as a patch and as a steer) through the server are the
    in-process ones; each SAE goes to the server once, however many requests read it."""
    sent = translator_posts(client, monkeypatch, SAE_POSTS)
    jumprelu, topk, standard = saes.values()
    pair = [jumprelu, topk]
    for remote, local in zip(
        client.features(PROMPT, pair, top_k=8), tiny2.features(PROMPT, pair, top_k=8)
    ):
        assert_same_features(remote, local)
    prompts = [PROMPT, "Hello world"]
    remote = client.features(prompts, jumprelu, top_k=4, features=[0, 17, 255])
    local = tiny2.features(prompts, jumprelu, top_k=4, features=[0, 17, 255])
    for a, b in zip(remote, local, strict=True):
        assert_same_features(a, b)
    kwargs = dict(layers=[standard.layer, -1], top_k=5, splice=standard)
    assert_same_lens(client.lens(PROMPT, **kwargs), tiny2.lens(PROMPT, **kwargs))
    strongest = int(local[0].top_ids[-1, 0])  # at the last position
    clamp = ek.Clamp(jumprelu, [strongest, 7], [0.0, 200.0])
    for case in (dict(patch=clamp), dict(steer=clamp)):
        remote, local = client.lens(PROMPT, top_k=5, **case), tiny2.lens(PROMPT, top_k=5, **case)
        assert remote.meta["steer"][0]["sae"] == jumprelu.key
        assert_same_lens(remote, local)
    generated = client.generate(PROMPT, 8, steer=clamp)
    assert generated.token_ids == tiny2.generate(PROMPT, 8, steer=clamp).token_ids
    assert generated.token_ids != client.generate(PROMPT, 8).token_ids  # the clamp did apply
    assert sent == [SAE_POSTS + sae.key for sae in (jumprelu, topk, standard)]
    client.features(PROMPT, pair)
    client.lens(PROMPT, splice=standard)
    assert len(sent) == 3  # held by the ranks: nothing sent again
    whole = sum(
        t.numel() * 4 for t in (jumprelu.W_enc, jumprelu.b_enc, jumprelu.W_dec, jumprelu.threshold)
    )
    assert client.sae_bytes(jumprelu) == tiny2.sae_bytes(jumprelu) == [whole // 2 + 128 * 4] * 2
    with httpx.Client(base_url=server.url, headers={"ndif-api-key": server.token()}) as http:
        path = SAE_POSTS + jumprelu.key
        assert http.get(path, timeout=30).json() == {"key": jumprelu.key, "installed": True}
        assert http.post(path, content=jumprelu.to_bytes(), timeout=30).json() == {
            "key": jumprelu.key
        }
        assert http.get(path, headers={"ndif-api-key": "wrong"}).status_code == 401
        assert http.post(path, content=b"x", headers={"ndif-api-key": "wrong"}).status_code == 401


def test_a_full_server_keeps_the_saes_a_request_reads(client, tiny2, saes, monkeypatch):
    """With the ranks full (`InstalledSAEs.LIMIT` SAEs), a request reading a held SAE and a
    new one drops a third: asking whether the held one is there marks it as just used."""
    base = saes["saelens_jumprelu"]
    fields = {name: getattr(base, name) for name in base.__dataclass_fields__ if name != "key"}
    shifted = [
        ek.SAE(**{**fields, "b_enc": base.b_enc + 1e-3 * (i + 1)})
        for i in range(InstalledSAEs.LIMIT + 1)
    ]
    sent = translator_posts(client, monkeypatch, SAE_POSTS)
    client.features(PROMPT, shifted[:-1], top_k=4)
    assert len(sent) == InstalledSAEs.LIMIT
    pair = [shifted[0], shifted[-1]]
    for remote, local in zip(
        client.features(PROMPT, pair, top_k=4), tiny2.features(PROMPT, pair, top_k=4)
    ):
        assert_same_features(remote, local)
    assert sent[InstalledSAEs.LIMIT :] == [SAE_POSTS + shifted[-1].key]


def test_sae_refusals_through_the_server(server, client, saes):
    """An SAE that does not fit the served model: `InvalidRequest`, as in process; a body
    that is not an SAE, or not the SAE of its key, is refused with 400, one that does not
    fit with 422, and nothing is installed; the server serves on."""
    import torch

    sae = saes["saelens_jumprelu"]
    wide = ek.SAE(
        "relu", torch.zeros(576, 8), torch.zeros(8), torch.zeros(8, 576), torch.zeros(576), layer=1
    )
    fields = {name: getattr(sae, name) for name in sae.__dataclass_fields__ if name != "key"}
    # Other weights too, so that nothing the ranks hold has their keys.
    other = ek.SAE(**{**fields, "model_name": "SmolLM2-135M-Instruct", "b_enc": sae.b_enc + 1})
    deep = ek.SAE(**{**fields, "layer": 9, "b_enc": sae.b_enc + 2})
    with pytest.raises(ek.InvalidRequest, match="d_model=128"):
        client.features(PROMPT, wide)
    with pytest.raises(ek.InvalidRequest, match="d_model=128"):
        client.lens(PROMPT, splice=wide)
    with pytest.raises(ek.InvalidRequest, match="model_check=False"):
        client.features(PROMPT, other)
    with pytest.raises(ek.InvalidRequest, match="out of range"):
        client.lens(PROMPT, patch=ek.Clamp(sae, 256, 1.0))
    blob = sae.to_bytes()
    bodies = {
        "empty": (b"", "not an SAE sent by envoykit"),
        "truncated": (blob[: len(blob) // 2], "not an SAE sent by envoykit"),
        "pickle": (b"\x80\x04K\x01.", "not an SAE sent by envoykit"),
        "wire only": (sae.to_wire()[1], "not an SAE sent by envoykit"),
        "other key": (blob, f"key {sae.key}, not {sae.key[::-1]}"),
    }
    with httpx.Client(base_url=server.url, headers={"ndif-api-key": server.token()}) as http:
        for name, (body, message) in bodies.items():
            path = SAE_POSTS + sae.key[::-1]  # a key nothing has
            response = http.post(path, content=body, timeout=30)
            assert response.status_code == 400, (name, response.text)
            assert response.json()["invalid_request"] is True
            assert message in response.json()["detail"], (name, response.text)
            assert http.get(path, timeout=30).json()["installed"] is False
        for unfit, message in (
            (wide, "d_model=128"),
            (other, "model_check=False"),
            (deep, "past tiny's 4 layers"),
        ):
            path = SAE_POSTS + unfit.key
            response = http.post(path, content=unfit.to_bytes(), timeout=30)
            assert response.status_code == 422, response.text
            assert message in response.json()["detail"], response.text
            assert http.get(path, timeout=30).json()["installed"] is False
            assert http.get(path + "/bytes", timeout=30).json() == {"key": unfit.key, "bytes": None}
    assert client.features(PROMPT, sae, top_k=3).top_ids.shape[1] == 3


def test_a_client_without_the_checkpoint_gets_its_files(server, client, tmp_path, monkeypatch):
    """A client on another machine has no checkpoint at the server's path: the server sends
    the config and tokenizer (never weights) and the tree built from them gives the same lens.
    The other machine is this one with the server's path taken for absent."""
    from envoykit.serve import client as client_module

    have = client_module._same_files
    away = client.info.path
    monkeypatch.setattr(client_module, "_same_files", lambda d, f: str(d) != away and have(d, f))
    token = server.token()
    monkeypatch.setenv("ENVOYKIT_CACHE", str(tmp_path))  # no record of the server there
    with ek.connect(server.url, token=token) as elsewhere:
        (copy,) = (tmp_path / "served").iterdir()
        names = sorted(path.name for path in copy.iterdir())
        assert "config.json" in names and "tokenizer.json" in names
        assert not [name for name in names if name.endswith(".safetensors")]
        assert elsewhere.model.args[0] == str(copy)
        assert_same_lens(elsewhere.lens(PROMPT, top_k=3), client.lens(PROMPT, top_k=3))


def test_cli_lens_through_the_server(server, tiny2, tmp_path):
    figure = tmp_path / "lens.png"
    command = ["lens", PROMPT, "--server", server.url, "--target", " Paris", "--out", figure]
    out = subprocess.run(
        [sys.executable, "-m", "envoykit.cli", *map(str, command)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = tiny2.lens(PROMPT, layers=["embed", "all"], targets=[" Paris"])
    for (layer, token, _), line in zip(res.top1(-1), out.stdout.splitlines()[2:]):
        assert line.split(":", 1)[1].strip().startswith(repr(token)), (layer, line)
    assert figure.stat().st_size > 0


def test_cli_steer_through_the_server(server, tiny2, tmp_path):
    saved, stored = tmp_path / "v.safetensors", tmp_path / "steer.json"
    command = [sys.executable, "-m", "envoykit.cli", "steer", PROMPT, "--server", server.url]
    vector = ["--positive", "I love it", "--negative", "I hate it", "--layer", "2"]
    out = subprocess.run(
        [*command, *vector, "--scales", "2", "--max-tokens", "6", "--target", "e",
         "--save-vector", str(saved), "--json", str(stored), "--out", str(tmp_path / "s.png")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    steer = ek.Steer(ek.SteeringVector.load(saved), 2, scale=2.0)
    expected = tiny2.generate(PROMPT, 6, steer=steer)
    assert f"scale      +2: {str(expected)!r}" in out.stdout
    assert ek.SteerSweepResult.from_json(str(stored)).token_ids[1] == expected.token_ids
    bad = subprocess.run(
        [*command, "--positive", "I love it", "--layer", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "at least one --positive and one --negative" in bad.stderr
    assert "Traceback" not in bad.stderr


CORPUS = [
    "The capital of France is Paris. The capital of Germany is Berlin.",
    "One, two, three, four, five, six, seven.",
    "Monday, Tuesday, Wednesday",
]


def test_corpus_work_through_the_server_equals_in_process(client, tiny2, tmp_path):
    import torch

    remote = client.lens_corpus(CORPUS, top_k=2, batch_tokens=16, progress=False)
    local = tiny2.lens_corpus(CORPUS, top_k=2, batch_tokens=16, progress=False)
    np.testing.assert_allclose(remote.document_sums, local.document_sums, atol=1e-9)
    np.testing.assert_array_equal(remote.document_counts, local.document_counts)
    kwargs = {"layers": [1, 3], "sites": ["resid", "mlp"], "dtype": "float32", "progress": False}
    there = client.collect(CORPUS, out=tmp_path / "remote", batch_tokens=16, **kwargs)
    here = tiny2.collect(CORPUS, out=tmp_path / "local", **kwargs)
    assert len(there.shard_files) > 1
    for layer, site in [(1, "resid"), (3, "mlp")]:
        assert torch.equal(there.load(layer, site), here.load(layer, site))
    np.testing.assert_array_equal(there.positions, here.positions)


def test_feature_stats_equal_in_process(client, tiny2, saes, tmp_path):
    """A corpus pass through the server: the ranks' tallies come back as in process, and
    the store is written on the client's side."""
    topk = saes["saelens_topk"]
    texts = ek.shipped_corpus()[:8]
    kwargs = dict(contexts=3, window=5, batch_tokens=96, progress=False)
    remote = client.feature_stats(texts, topk, out=tmp_path / "stats", **kwargs)
    local = tiny2.feature_stats(texts, topk, **kwargs)
    for name in ("fired", "histograms", "top_documents", "top_positions", "window_ids"):
        np.testing.assert_array_equal(getattr(remote, name), getattr(local, name))
    for name in ("activation_sum", "top_acts", "window_acts"):
        np.testing.assert_allclose(getattr(remote, name), getattr(local, name), rtol=1e-6)
    assert ek.FeatureStats.open(tmp_path / "stats").contexts(0) == remote.contexts(0)


def test_cli_corpus_commands_through_the_server(server, tiny2, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": text}) + "\n" for text in CORPUS))
    command = [sys.executable, "-m", "envoykit.cli"]
    table, figure = tmp_path / "lens.csv", tmp_path / "lens.png"
    lens = subprocess.run(
        [*command, "lens-corpus", str(corpus), "--server", server.url, "--csv", str(table),
         "--out", str(figure)],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert lens.returncode == 0, lens.stderr[-2000:]
    expected = tiny2.lens_corpus(CORPUS, layers=["embed", "all"], progress=False)
    assert f"over {expected.n_documents} documents, {expected.n_tokens} tokens" in lens.stdout
    rows = table.read_text().splitlines()
    assert len(rows) == len(expected.layers) + 1 and figure.stat().st_size > 0
    assert float(rows[1].split(",")[1]) == pytest.approx(expected.kl[0], abs=1e-6)
    store = tmp_path / "store"
    collect = subprocess.run(
        [*command, "collect", str(corpus), "--server", server.url, "--out", str(store),
         "--layers", "2"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert collect.returncode == 0, collect.stderr[-2000:]
    assert ek.Activations.open(store).n_documents == len(CORPUS)
    bad = subprocess.run(
        [*command, "collect", str(tmp_path / "missing.txt"), "--server", server.url, "--out",
         str(tmp_path / "other")],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert bad.returncode == 2 and "no corpus file" in bad.stderr and "Traceback" not in bad.stderr


def test_cli_attention_through_the_server(server, tiny2, tmp_path):
    figure, stored = tmp_path / "attention.png", tmp_path / "attention.json"
    command = ["attention", PROMPT, "--server", server.url, "--layer", "2", "--head", "1"]
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "envoykit.cli",
            *command,
            "--out",
            str(figure),
            "--json",
            str(stored),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    res = tiny2.attention(PROMPT, layers=[2], heads=[1])
    lines = out.stdout.splitlines()[2 : 2 + len(res.queries)]
    for row, line in enumerate(lines):  # "query token -> most attended key, its token, weight"
        assert line.split("->")[1].split()[0] == str(int(res.weights[0, 0, row].argmax()))
    np.testing.assert_allclose(
        ek.AttentionResult.from_json(str(stored)).weights, res.weights, atol=1e-6
    )
    assert figure.stat().st_size > 0
    bad = subprocess.run(
        [sys.executable, "-m", "envoykit.cli", *command[:-1], "99", "--out", str(figure)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert bad.returncode == 2 and "head 99 is out of range" in bad.stderr
    assert "Traceback" not in bad.stderr


# -- the token ----------------------------------------------------------------------------


def test_every_path_but_health_needs_the_token(server):
    good = {"ndif-api-key": server.token()}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        assert http.get("/health").status_code == 200
        for path in ("/v1/envoykit/info", "/v1/envoykit/status", "/docs", "/openapi.json"):
            assert http.get(path).status_code == 401, path
            assert http.get(path, headers={"ndif-api-key": "wrong"}).status_code == 401, path
        assert http.post("/v1/nnsight/generate", content=b"x").status_code == 401
        assert http.get("/v1/envoykit/info", headers=good).status_code == 200
    with pytest.raises(ek.ServerUnavailable, match="refused the token"):
        ek.connect(server.url, token="not-the-token")


def test_a_trace_with_a_wrong_token_does_not_run(client, tmp_path):
    """The same trace writes a file on the server with the token, and nothing without it."""
    from nnsight.modeling.vllm.serve.backend import LocalServeBackend

    marker = str(tmp_path / "ran")
    wrong = LocalServeBackend(client.model, client.url, api_key="wrong")
    with pytest.raises(ConnectionError, match="401"):
        with client.model.trace(PROMPT, max_tokens=1, backend=wrong):
            open(marker, "w").close()
    assert not os.path.exists(marker)
    with client.trace(PROMPT):
        open(marker, "w").close()
    assert os.path.exists(marker)


# -- faults: a clear error at the client, a server that keeps serving ---------------------


def test_errors_come_back_as_in_process(client, tiny2):
    expected = tiny2.lens(PROMPT, top_k=3)
    for engine in (client, tiny2):
        with pytest.raises(ek.ShardedValue, match="act_fn"):
            with engine.trace(PROMPT):
                engine.model.model.layers[0].mlp.act_fn.output.save()
        with pytest.raises(ek.InvalidRequest, match="LM head"):  # raised on the ranks
            with engine.trace(PROMPT):
                engine.model.lm_head(engine.model.model.embed_tokens.input).save()
        with pytest.raises(ek.InvalidRequest, match="layer 9 does not exist"):  # before
            engine.lens(PROMPT, layers=[9])
        with pytest.raises(RuntimeError, match="ValueError: invalid literal"):
            with engine.trace(PROMPT):
                engine.model.logits.save()
                int("not a number")
    assert_same_lens(client.lens(PROMPT, top_k=3), expected)


def test_malformed_body_is_400(server, client):
    with httpx.Client(base_url=server.url, headers={"ndif-api-key": server.token()}) as http:
        for body in (b"", b"not a trace", b"\x80\x04K\x01."):  # the last: pickle of 1
            response = http.post("/v1/nnsight/generate", content=body, timeout=30)
            assert response.status_code == 400, (body, response.text)
            assert "not a serialized nnsight trace" in response.json()["detail"]
    assert client.generate_ids(PROMPT, 2)


def test_a_client_gone_while_sending_its_body_leaves_no_traceback(server, client):
    """A kernel killed while its trace is still uploading: the server reads half a body, then
    the end of the connection. Nothing runs, nothing is printed, the next request is served."""
    import socket

    host, port = server.url.removeprefix("http://").split(":")
    before = len(server.stderr())
    head = (
        f"POST /v1/nnsight/generate HTTP/1.1\r\nHost: {host}\r\n"
        f"ndif-api-key: {server.token()}\r\nContent-Length: 100000\r\n\r\n"
    )
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        sock.sendall(head.encode() + b"\x80" * 1000)
        time.sleep(0.5)  # the server is reading the body when the connection ends
    assert client.generate_ids(PROMPT, 2)
    assert "Traceback" not in server.stderr()[before:]


SLOW_CLIENT = """
import time, envoykit as ek
client = ek.connect({url!r})
print("CONNECTED", flush=True)
with client.trace({prompt!r}, max_tokens=200, ignore_eos=True) as tracer:
    for step in tracer.iter[:200]:
        time.sleep(0.1)  # on the ranks: twenty seconds in all
        client.model.logits.save()
"""


def test_client_killed_mid_request_is_aborted_and_freed(server, client):
    """A client killed during a 20-second request: within seconds the server holds no
    request and no worker for it, and answers the next one."""
    expected = client.lens(PROMPT, top_k=3)
    slow = subprocess.Popen(
        [sys.executable, "-c", SLOW_CLIENT.format(url=server.url, prompt=PROMPT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert slow.stdout.readline().strip() == "CONNECTED"
        deadline = time.monotonic() + 120
        while client.status()["in_flight"] == 0:
            assert time.monotonic() < deadline and slow.poll() is None
            time.sleep(0.2)
        time.sleep(1)
    finally:
        slow.kill()
        slow.wait()
    killed = time.monotonic()
    while (status := client.status(workers=True)) != {"in_flight": 0, "workers": [0, 0]}:
        assert time.monotonic() - killed < 8, status
        time.sleep(0.2)
    assert_same_lens(client.lens(PROMPT, top_k=3), expected)


def test_concurrent_clients_get_serial_results(server, client):
    """Two connections (two kernels' worth) running lenses at once get what serial runs gave."""
    prompts = [PROMPT, "Hello world, said the", "One two three four", "A B C D E"]
    serial = {p: client.lens(p, top_k=5, generate=3) for p in prompts}
    results: dict[str, list] = {}

    def run(name: str) -> None:
        with ek.connect(server.url) as mine:
            results[name] = [(p, mine.lens(p, top_k=5, generate=3)) for p in prompts * 2]

    threads = [threading.Thread(target=run, args=(name,)) for name in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert sorted(results) == ["a", "b"]
    for name in "ab":
        for prompt, res in results[name]:
            assert_same_lens(res, serial[prompt])


def test_cancel_through_a_connection_stops_the_lens_on_the_ranks(server, client):
    """connection.cancel() from another thread: the server raises the flag its ranks look
    for, the lens raises ek.Cancelled, and the connection answers the next lens; a key
    that is not one is refused."""
    expected = client.lens(PROMPT, top_k=3)
    box: dict = {}

    def run() -> None:
        try:
            box["result"] = client.lens(" ".join([PROMPT] * 32), top_k=3)
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=run)
    thread.start()
    while thread.is_alive() and not client.cancel(thread):
        time.sleep(0.001)
    thread.join(120)
    assert isinstance(box.get("error"), ek.Cancelled), box
    assert_same_lens(client.lens(PROMPT, top_k=3), expected)
    headers = {"ndif-api-key": server.token()}
    refused = httpx.post(f"{server.url}/v1/envoykit/cancel/{'x' * 32}", headers=headers)
    assert refused.status_code == 400 and "not a cancel key" in refused.text, refused.text


def test_requests_leave_nothing_behind_in_the_server(server, client):
    """Each request's trace is freed once it is answered: the server process's memory after
    150 more lenses is what it was (each request's tracer, kept by mistake, is about 130 KiB:
    20 MiB over 150). The engine's processes are not counted: their allocators keep a high
    water mark that depends on the batches seen."""
    process = psutil.Process(server.process.pid)
    for _ in range(20):  # warm: imports, caches and the allocator's first arenas
        client.lens(PROMPT, top_k=5)
    before = process.memory_info().rss
    for _ in range(150):
        client.lens(PROMPT, top_k=5)
    grown = process.memory_info().rss - before
    assert grown < 6 * 2**20, f"the server grew {grown / 2**20:.1f} MiB over 150 lenses"


LOOPING_CLIENT = """
import envoykit as ek
client = ek.connect({url!r})
print("CONNECTED", flush=True)
while True:
    client.lens({prompt!r}, top_k=5, generate=8)
"""


def test_four_clients_while_one_is_killed_at_random_get_serial_results(server, client):
    """Load: three clients run lenses while a fourth, running lenses in a loop, is killed at
    a random moment, three times over. The server serves on, the killed requests are freed,
    and every other result equals the serial one."""
    import random

    prompts = [PROMPT, "Hello world, said the", "One two three four", "A B C D E"]
    serial = {p: client.lens(p, top_k=5, generate=3) for p in prompts}
    results: dict[int, list] = {}
    errors: list[BaseException] = []

    def run(name: int) -> None:
        try:
            with ek.connect(server.url) as mine:
                results[name] = [(p, mine.lens(p, top_k=5, generate=3)) for p in prompts * 3]
        except BaseException as error:  # reported below, not lost in the thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(name,)) for name in range(3)]
    for thread in threads:
        thread.start()
    chance = random.Random(0)
    try:
        for _ in range(3):
            victim = subprocess.Popen(
                [sys.executable, "-c", LOOPING_CLIENT.format(url=server.url, prompt=PROMPT)],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            try:
                assert victim.stdout.readline().strip() == "CONNECTED"
                time.sleep(chance.uniform(0.5, 3.0))
            finally:
                victim.kill()
                victim.wait()
    finally:
        for thread in threads:
            thread.join(600)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]
    for found in results.values():
        for prompt, res in found:
            assert_same_lens(res, serial[prompt])
    idle = time.monotonic()
    while (status := client.status(workers=True)) != {"in_flight": 0, "workers": [0, 0]}:
        assert time.monotonic() - idle < 8, status
        time.sleep(0.2)
    assert_same_lens(client.lens(PROMPT, top_k=5, generate=3), serial[PROMPT])


def test_no_server_is_a_clear_error_within_the_timeout(tmp_path, monkeypatch):
    connect = ek.connect  # imported: the time below is the wait for an answer
    with socket_listening_silently() as url:
        began = time.monotonic()
        with pytest.raises(ek.ServerUnavailable, match="did not answer within 1 s"):
            connect(url, token="t" * 20, timeout=1)
        assert time.monotonic() - began < 3
    with pytest.raises(ek.ServerUnavailable, match="no envoykit server answers"):
        ek.connect(url, token="t" * 20, timeout=1)  # now nothing listens there
    monkeypatch.setenv("ENVOYKIT_CACHE", str(tmp_path))
    monkeypatch.delenv("ENVOYKIT_SERVER", raising=False)
    with pytest.raises(ek.ServerUnavailable, match="no envoykit server of yours"):
        ek.connect()
    with pytest.raises(ek.ServerUnavailable, match="no token"):
        ek.connect(url)


@contextlib.contextmanager
def socket_listening_silently():
    import socket

    with socket.create_server(("127.0.0.1", 0)) as listener:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


# What a stop must not print: tracebacks from vLLM's finalizers, resource-tracker warnings.
STOP_NOISE = ("Traceback", "Exception ignored", "resource_tracker", "leaked", "Error")


def assert_stopped_quietly(served: Server) -> None:
    """The stop's stderr: the start's progress and the stop line, nothing else."""
    stop = served.stderr().split("ready: 100%")[-1]
    assert not [word for word in STOP_NOISE if word in stop], stop[-3000:]
    assert "envoykit serve: stopped; the engine is closed" in stop


def test_sigterm_leaves_nothing(server, client):
    """Last in this module: SIGTERM stops the shared server; exit 0, nothing left, nothing
    printed but the stop line, and its client gets a clear error."""
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(60) == 0
    server.assert_nothing_left(10)
    assert_stopped_quietly(server)
    with pytest.raises(ek.ServerUnavailable, match="no envoykit server answers"):
        client.lens(PROMPT)


def test_ctrl_c_stops_quietly_and_leaves_nothing(tmp_path):
    """Ctrl-C (SIGINT) after some work: exit 0, nothing left, nothing printed but the stop."""
    served = Server(tmp_path)
    try:
        with ek.connect(served.url) as connection:
            connection.lens(PROMPT, top_k=5)
        served.process.send_signal(signal.SIGINT)
        assert served.process.wait(60) == 0
        served.assert_nothing_left(10)
        assert_stopped_quietly(served)
    finally:
        served.stop()


# -- faults that end a server -------------------------------------------------------------


def test_killed_rank_gives_engine_dead_and_the_server_exits_saying_why(tmp_path):
    served = Server(tmp_path)
    try:
        with ek.connect(served.url) as connection:
            assert connection.generate_ids(PROMPT, 2)
            kill_a_rank_during_a_lens(served, connection)
            assert served.process.wait(60) == 3
            assert "the engine's processes died" in served.stderr()
            assert "VLLM::Worker_TP1" in served.stderr()
            served.assert_nothing_left(30)
            with pytest.raises(ek.ServerUnavailable):
                connection.lens(PROMPT)
    finally:
        served.stop()


def test_restart_then_killed_server_leaves_nothing(tmp_path):
    """With --restart a killed rank gives `EngineDead`, then a fresh engine serves the same
    lens. kill -9 of the server then: its ranks die with it, janitors remove its shared
    memory and its token record."""
    served = Server(tmp_path, "--restart")
    try:
        assert len(served.engine_pids) == 3 and served.segments and served.scratch
        with ek.connect(served.url) as connection:
            expected = connection.lens(PROMPT, top_k=3)
            kill_a_rank_during_a_lens(served, connection)
            deadline = time.monotonic() + START_SECONDS
            while True:
                assert time.monotonic() < deadline and served.process.poll() is None
                try:
                    restarted = connection.lens(PROMPT, top_k=3)
                    break
                except ek.EngineDead:  # the server has not noticed yet
                    time.sleep(0.2)
                except ek.ServerUnavailable as error:  # while the new engine starts
                    assert "restarting" in str(error)
                    time.sleep(1)
            assert_same_lens(restarted, expected)
        served.watch_engine()
        assert len(served.engine_pids) == 6
        served.process.kill()
        served.process.wait()
        served.assert_nothing_left(30)
    finally:
        served.stop()


def kill_a_rank_during_a_lens(served: Server, connection) -> None:
    """Kill rank 1 while a long lens runs: the lens must end in `EngineDead`."""
    box: dict = {}

    def long_lens() -> None:
        try:
            connection.lens([PROMPT] * 8, generate=200, top_k=3)
        except BaseException as error:
            box["error"] = error

    thread = threading.Thread(target=long_lens)
    thread.start()
    while connection.status()["in_flight"] == 0:
        time.sleep(0.1)
    served.rank(1).kill()
    thread.join(60)
    assert isinstance(box.get("error"), ek.EngineDead), box
