"""Checkpoints in an object store (checkpoint.dir = s3://...), against a real S3 server on the loopback.

The server is moto's (the same WSGI application ``moto_server`` serves), started in this process so that a test
can act at the moment a request arrives: ``KillOnPut`` SIGKILLs a training process while its upload of a
checkpoint is in flight, with no timing guess. Training processes reach it over HTTP through s3fs, with
credentials in the environment only, as on a cluster.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("s3fs")
moto_server = pytest.importorskip("moto.moto_server.werkzeug_app")

from tests.distributed import free_port, run_distributed  # noqa: E402
from tests.helpers import args, records  # noqa: E402
from treadle.checkpoint.remote_manager import refuse_engine  # noqa: E402
from treadle.cli import main  # noqa: E402
from treadle.errors import UserError  # noqa: E402

SECRET = "sEcReT-never-in-a-log-0123456789"
LOSS_RTOL = 1e-5
COMMON = ("--train.max_steps=6", "--checkpoint.every=2", "--checkpoint.keep_last=2", "--train.eval_every=2",
          "--checkpoint.best_metric=eval_loss")


class KillOnPut:
    """WSGI middleware: when a PUT's path matches ``pattern``, SIGKILL ``victim`` before the store answers."""

    def __init__(self, app):
        self.app, self.pattern, self.victim, self.fired = app, None, None, threading.Event()

    def __call__(self, environ, start_response):
        victim = self.victim
        if victim is not None and environ["REQUEST_METHOD"] == "PUT" and re.search(self.pattern, environ["PATH_INFO"]):
            self.victim = None
            victim.kill()
            victim.wait()
            self.fired.set()
            start_response("500 Internal Server Error", [("Content-Length", "0")])
            return [b""]  # the request dies with its sender: nothing of it is stored
        return self.app(environ, start_response)


@pytest.fixture(scope="module")
def store():
    from werkzeug.serving import make_server

    app = KillOnPut(moto_server.DomainDispatcherApplication(moto_server.create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=moto_server.MotoRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{server.server_port}", "AWS_ACCESS_KEY_ID": "test-key-id",
           "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1"}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        import boto3

        client = boto3.client("s3")
        client.create_bucket(Bucket="ckpts")
        yield app, client
    server.shutdown()
    thread.join()


def _objects(client, prefix: str) -> dict[str, bytes]:
    listed = client.list_objects_v2(Bucket="ckpts", Prefix=prefix + "/").get("Contents", [])
    return {o["Key"][len(prefix) + 1:]: client.get_object(Bucket="ckpts", Key=o["Key"])["Body"].read() for o in listed}


def _steps(objects: dict) -> tuple[set, set]:
    """(committed, every) step_<N> names among the objects."""
    every = {k.split("/")[0] for k in objects if k.startswith("step_")}
    return {s for s in every if f"{s}/COMMITTED" in objects}, every


def _clear_clients():
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # a client keeps the credentials and endpoint it was made with


def test_sigkill_mid_upload_loses_nothing_and_resume_equals_the_uninterrupted_run(store, shards, tmp_path, capfd,
                                                                                   caplog):
    app, client = store
    ref = tmp_path / "ref"  # uninterrupted, checkpoints on local disk
    assert main(args(shards, ref, *COMMON)) == 0

    # Killed when step 4's last object, its COMMITTED, is on its way: every other object of step 4 is in the store
    # (a reader must still not take it), step 2 is committed; async save: the writer is a background thread.
    run = tmp_path / "run"
    url = "s3://ckpts/runs/a"
    cmd = [sys.executable, "-m", "treadle", *args(shards, run, *COMMON, f"--checkpoint.dir={url}",
                                                   "--checkpoint.async_save=true")]
    app.pattern = r"^/ckpts/runs/a/step_4/COMMITTED$"
    app.victim = proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    killed_log, _ = proc.communicate(timeout=300)
    assert app.fired.is_set() and proc.returncode == -9, killed_log
    objects = _objects(client, "runs/a")
    committed, every = _steps(objects)
    assert committed == {"step_2"} and {"step_4/train_state.json", "step_4/state/.metadata"} <= objects.keys()
    assert objects["latest"] == b"step_2"

    # The next start resumes from step 2, clears the partial step 4 and ends as the uninterrupted run did.
    capfd.readouterr()
    assert main(args(shards, run, *COMMON, f"--checkpoint.dir={url}", "--checkpoint.async_save=true")) == 0
    out, err = capfd.readouterr()
    assert f"resumed from {url}/step_2 at step 2" in out + err
    # a logging warning: on stderr in a plain process, in pytest's log capture here (pytest installs root handlers)
    assert "removed uncommitted step_4" in out + err + caplog.text
    for key in ("loss", "eval_loss", "grad_norm", "lr"):
        assert records(run, key) == records(ref, key), key
    objects = _objects(client, "runs/a")
    committed, every = _steps(objects)
    assert committed == every == {"step_4", "step_6"}  # keep_last = 2; nothing uncommitted left
    assert objects["latest"] == objects["best"] == b"step_6"  # eval_loss falls at every evaluation
    assert json.loads(objects["best.json"])["step"] == 6
    assert not (run / "checkpoints").exists()  # nothing went to local disk
    # Credentials come from the environment and appear nowhere treadle writes.
    for text in (killed_log, out, err, (run / "config.toml").read_text(), (run / "metrics.jsonl").read_text(),
                 objects["step_6/config.toml"].decode()):
        assert SECRET not in text and "test-key-id" not in text

    # A checkpoint in the store exports as one on disk does: the run's own export at step 6.
    assert main(["export", url, str(tmp_path / "exported")]) == 0
    a, b = load_file(run / "hf" / "model.safetensors"), load_file(tmp_path / "exported" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # An explicit rollback to step 4 (a URL for checkpoint.resume): step 6 removed, then trained and saved again.
    assert main(args(shards, run, *COMMON, f"--checkpoint.dir={url}", f"--checkpoint.resume={url}/step_4",
                     "--checkpoint.allow_rollback=true")) == 0
    assert records(run) == records(ref)
    objects = _objects(client, "runs/a")
    assert _steps(objects) == ({"step_4", "step_6"},) * 2 and objects["latest"] == b"step_6"
    capfd.readouterr()

    # Another run (another train.output_dir) pointed at these checkpoints is refused, nothing written.
    other = tmp_path / "other"
    assert main(args(shards, other, *COMMON, f"--checkpoint.dir={url}")) == 2
    err = capfd.readouterr().err.strip()
    assert "holds another run's checkpoints" in err and len(err.splitlines()) == 1, err
    assert not other.exists() and _objects(client, "runs/a") == objects


def _fsdp2_runs(rank, world_size, shards, out, url):
    from treadle.config import load_config
    from treadle.train.callbacks import Callback
    from treadle.train.run import build_trainer

    class StopAfter(Callback):  # as a scheduler's signal would: a checkpoint, then the run stops
        def on_step_end(self, trainer, result):
            if trainer.state.step == 2:
                trainer.request_stop("test")

    cfg = load_config(None, args(shards, out, "--train.threads=1", "--train.max_steps=4", "--checkpoint.every=0",
                                 "--distributed.engine=fsdp2", "--checkpoint.async_save=true",
                                 f"--checkpoint.dir={url}")[1:])
    first = build_trainer(cfg)
    first.callbacks.insert(0, StopAfter())
    first.fit()
    first.metrics.close()
    second = build_trainer(cfg)  # auto-resume from the store: every rank reads its shards through DCP's fsspec reader
    second.fit()
    second.metrics.close()
    return str(second.resumed_from), second.state.step


def test_fsdp2_on_two_ranks_saves_to_and_resumes_from_the_store(store, shards, tmp_path, monkeypatch):
    _, client = store
    _clear_clients()
    url = "s3://ckpts/runs/fsdp2"
    res = run_distributed(_fsdp2_runs, world_size=2, timeout=240, shards=shards, out=tmp_path / "two", url=url)
    assert res[0] == res[1] == (f"{url}/step_2", 4)
    objects = _objects(client, "runs/fsdp2")
    assert {"step_2/rng/rank_0.json", "step_2/rng/rank_1.json", "step_4/COMMITTED"} <= objects.keys()
    assert {k for k in objects if k.startswith("step_4/state/")} >= {"step_4/state/__0_0.distcp",
                                                                       "step_4/state/__1_0.distcp"}
    # Two ranks at GA 2, stopped and resumed through the store, train as one process at GA 4 does.
    one = tmp_path / "one"
    assert main(args(shards, one, "--train.max_steps=4", "--train.grad_accum_steps=4")) == 0
    for key in ("loss", "grad_norm"):
        a, b = records(one, key), records(tmp_path / "two", key)
        assert a.keys() == b.keys() == {1, 2, 3, 4}
        assert all(abs(a[s] - b[s]) <= LOSS_RTOL * abs(a[s]) for s in a), (key, a, b)


def test_bad_object_store_locations_are_one_line_and_exit_2(store, shards, tmp_path, capfd, monkeypatch):
    def refused(url, *extra):
        _clear_clients()
        out = tmp_path / f"out{len(seen)}"
        assert main(args(shards, out, "--train.max_steps=2", f"--checkpoint.dir={url}", *extra)) == 2
        err = capfd.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and "Traceback" not in err, err
        assert not out.exists()  # refused before the first write
        seen.append(err)
        return err

    seen: list[str] = []
    assert "no installed fsspec backend handles gs:// (Please install gcsfs" in refused("gs://ckpts/x")
    assert "fsspec cannot open nosuch://" in refused("nosuch://ckpts/x")
    assert "the bucket 'no-such-bucket' does not exist" in refused("s3://no-such-bucket/x")
    assert "holds credentials" in refused("s3://key:secret@ckpts/x")
    with pytest.raises(UserError, match=r"^checkpoint.dir = 's3://ckpts/ds' is an object store, and distributed"):
        refuse_engine("s3://ckpts/ds", "deepspeed")  # a one-process test cannot start deepspeed: its check alone
    with monkeypatch.context() as mp:  # no credentials anywhere boto looks
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
            mp.delenv(k)
        mp.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
        mp.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
        mp.setenv("AWS_EC2_METADATA_DISABLED", "true")
        assert "found none" in refused("s3://ckpts/x")
    with monkeypatch.context() as mp:
        mp.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
        assert "the object store cannot be reached" in refused("s3://ckpts/x")
    assert not any(SECRET in line for line in seen)
