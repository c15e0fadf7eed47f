"""Shared fixtures: one real local Ray for the whole session, a real idxmap corpus, a torchrun
launch of 2 CPU ranks that runs the modules' rank-side jobs (``launch_torchrun``), and the
longest Ray Train runs started with the session beside the tests (``prelaunched``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# every run also prints the machine's busy CPU time and its ten heaviest tests by it; a run
# whose process dies without pytest's summary says in which test and what Ray's logs say
pytest_plugins = ("cpu_time", "session_watch")


class _RankJobs:
    """The test process's end of tests/rank_jobs.py: a torchrun launch of 2 CPU ranks that
    runs rank-side jobs in turn, started on first use, and again for the next job after one
    failed (a failed job ends its launch) or after the tests between closed it."""

    def __init__(self):
        self.root = None  # one directory per session, an inbox per launch in it
        self.proc = None
        self.inbox = None
        self.log = None
        self.k = 0

    def _start(self) -> None:
        import subprocess
        import tempfile

        from ray_ppu.util.net import free_port

        self.root = self.root or Path(tempfile.mkdtemp(prefix="rank_jobs_"))
        self.inbox = Path(tempfile.mkdtemp(dir=self.root))
        self.log = open(self.inbox / "torchrun.log", "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port("127.0.0.1")), str(REPO / "tests" / "rank_jobs.py"),
             str(self.inbox)],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"},
            start_new_session=True)  # its ranks are killed with it (close)
        self.k = 0

    def run(self, script: str, jobs_file: Path, timeout: float) -> None:
        """Run ``script``'s ``__main__`` with ``jobs_file`` on both ranks; fails the test with
        the ranks' tracebacks (or the launch's output) if a rank raised or the launch died."""
        import json
        import time

        if self.proc is None or self.proc.poll() is not None:
            self._start()
        k = self.k
        (self.inbox / f"{k}.json").write_text(json.dumps({"script": script,
                                                          "jobs": str(jobs_file)}))
        answers = [self.inbox / f"{k}.rank{rank}.json" for rank in (0, 1)]
        deadline = time.monotonic() + timeout
        while not all(a.exists() for a in answers):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        errors = [json.loads(a.read_text()).get("error") for a in answers if a.exists()]
        if len(errors) == 2 and not any(errors):
            self.k += 1
            return
        why = "timed out" if self.proc.poll() is None else "the launch ended"
        self.close()  # a failed job ends its launch: the next one starts afresh
        output = (self.inbox / "torchrun.log").read_text()[-4000:]
        raise AssertionError("\n".join(e for e in errors if e)
                             or f"the ranks did not answer job {k} of {script} ({why}):\n{output}")

    def close(self) -> None:
        import signal
        import subprocess

        if self.proc is None:
            return
        (self.inbox / "stop").touch()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # a rank still in a job (timed out): all of them
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()
        self.proc = None


_RANKS = _RankJobs()


def launch_torchrun(script: str, jobs: dict, out: Path, timeout: float = 600) -> Path:
    """Run ``script``'s ``__main__`` on 2 CPU ranks with ``jobs`` (written to
    ``out/jobs.json``, its one argument), in the tests' torchrun launch (tests/rank_jobs.py);
    ``out`` back once both ranks returned."""
    import json

    (out / "jobs.json").write_text(json.dumps(jobs))
    _RANKS.run(str(script), out / "jobs.json", timeout)
    return out


def _uses_the_launch(item) -> bool:
    return hasattr(getattr(item, "module", None), "launch_torchrun")


def pytest_runtest_teardown(item, nextitem):
    """The torchrun launch ends when the next test does not use it (a module's jobs run
    together; the next module that needs it starts a new one): idle, its ranks would keep
    what the jobs built, and its gloo groups' threads poll (measured: ~8 % of a core per rank,
    for the rest of the suite)."""
    if _RANKS.proc is not None and not _uses_the_launch(nextitem):
        _RANKS.close()


@pytest.fixture(scope="session", autouse=True)
def _rank_jobs_end():
    """The torchrun launch (if one is running) stops with the session; its files go."""
    import shutil

    yield
    _RANKS.close()
    if _RANKS.root is not None:
        shutil.rmtree(_RANKS.root, ignore_errors=True)


sys.path.insert(0, str(REPO))


@pytest.fixture(scope="session", autouse=True)
def prelaunched(request, tmp_path_factory):
    """The longest Ray Train runs the collected tests need (tests/prelaunch.py ``RUNS``),
    started with the session in a helper driver beside the tests; their modules' fixtures
    take their results from it."""
    from prelaunch import ENABLED, RUNS, Prelaunch, inputs_of

    items = request.session.items
    wanted = [key for key in RUNS if any(key in item.fixturenames for item in items)]
    runs = Prelaunch({key: (tmp_path_factory.mktemp(key),
                            {name: request.getfixturevalue(name) for name in inputs_of(key)})
                      for key in wanted})
    if wanted:  # in the helper or, RAY_PPU_TESTS_PRELAUNCH=0, here: on the session's Ray
        ray = request.getfixturevalue("ray_cluster")
        if ENABLED:
            import session_watch

            log = tmp_path_factory.getbasetemp() / "prelaunch.log"
            runs.start(ray.get_runtime_context().gcs_address, log)
            session_watch.tell(session_watch.HELPER, str(log))
    yield runs
    runs.close()


# the tests' largest group (test_ppu_binding's 4 workers) beside a prelaunched run's 2
SIMULATED_PPUS = 8


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray whose raylet advertises simulated PPUs with per-unit ids."""
    import ray

    from ray_ppu.launch import ray_connect
    from ray_ppu.launch.launcher import UNIT_INSTANCE_RESOURCES

    os.environ["RAY_custom_unit_instance_resources"] = UNIT_INSTANCE_RESOURCES
    # the workers report their gauges every 2 s (Ray's default 10 s is most of a test run's
    # training on a busy machine: the metrics-endpoint test then scraped nothing)
    os.environ.setdefault("RAY_metrics_report_interval_ms", "2000")
    # started as a launch starts its own: the state API pinned to this instance (the suite's
    # launches in subprocesses start theirs beside it)
    ray_connect.start_local(num_cpus=8, resources={"PPU": SIMULATED_PPUS}, log_to_driver=True)
    yield ray

    import session_watch  # the plugin (pytest_plugins)

    def shutdown_ray() -> None:
        import psutil

        # the Ray this session started (its head's processes: the package's binaries and
        # scripts) and every process under them, the prelaunched runs' included; not the
        # session's other children (W&B's service, ended by W&B at exit). Ray's shutdown ends
        # them; one left (twice in seven full runs, a prelaunched run's TrainController, its
        # raylet gone) is killed here, not left behind
        package = os.path.dirname(ray.__file__)
        ours = []
        for child in psutil.Process().children():
            try:
                if any(package in part for part in child.cmdline()):
                    ours += [child, *child.children(recursive=True)]
            except psutil.Error:
                continue
        ray.shutdown()
        ray_connect.unpin()
        killed = session_watch.kill(psutil.wait_procs(ours, timeout=10)[1])
        if killed:
            print(f"conftest: killed what Ray's shutdown left behind: {', '.join(sorted(killed))}",
                  file=sys.__stderr__, flush=True)

    session_watch.shutdown_at_end(shutdown_ray)  # after pytest's summary, with a limit


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> str:
    """Standard-library sources tokenized with the real Qwen2 BPE into a Megatron idxmap."""
    from ray_ppu.data.preprocess import write_idxmap
    from ray_ppu.tools.demo import stdlib_sources
    from ray_ppu.data.tokenizer import qwen2

    prefix = tmp_path_factory.mktemp("corpus") / "stdlib_text_document"
    stats = write_idxmap(stdlib_sources(600_000), qwen2(), prefix)
    assert stats.tokens > 100_000
    return str(prefix)


class ByteTokenizer:
    """UTF-8 bytes as token ids (0-255), EOD 256, in a vocabulary of 384 (a multiple of
    64 × TP for TP ≤ 2: the padded vocabulary, hence the initial weights, are the same at TP 1
    and TP 2): what write_idxmap needs of a tokenizer."""

    eod, vocab_size = 256, 384

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [list(text.encode("utf-8")) for text in texts]


# What a run on byte_corpus sets: its vocabulary and its end-of-document id.
BYTE_VOCABULARY = [f"model.vocab_size={ByteTokenizer.vocab_size}",
                   f"data.eod_token_id={ByteTokenizer.eod}"]


@pytest.fixture(scope="session")
def byte_corpus(tmp_path_factory) -> str:
    """Standard-library sources as UTF-8 bytes, for runs whose subject is not the vocabulary:
    the CPU option matrix (its variants are held to each other) and the Hugging Face
    fine-tune under Ray Train (its padded vocabulary's masking, at any size).

    With Qwen2's 151,936-entry vocabulary, 98 % of the tiny model's 9.9 M parameters are its
    embedding and output layer: one step of two microbatches at sequence 32 took 0.58 s on
    one core, 0.05 s at a 4,096-entry vocabulary (one process, fp32). The runs that kill a
    worker keep the real corpus: their kills are timed against the iterations, and at 0.05 s
    a step the run is over before the kill lands."""
    from ray_ppu.data.preprocess import write_idxmap
    from ray_ppu.tools.demo import stdlib_sources

    prefix = tmp_path_factory.mktemp("byte_corpus") / "stdlib_bytes_document"
    stats = write_idxmap(stdlib_sources(400_000), ByteTokenizer(), prefix)
    assert stats.tokens > 100_000
    return str(prefix)


@pytest.fixture(scope="session")
def corpus_b(tmp_path_factory) -> str:
    """A second, smaller idxmap (the first corpus's files in reverse order): blends need two."""
    from ray_ppu.data.preprocess import write_idxmap
    from ray_ppu.tools.demo import stdlib_sources
    from ray_ppu.data.tokenizer import qwen2

    prefix = tmp_path_factory.mktemp("corpus_b") / "stdlib_reversed_text_document"
    write_idxmap(reversed(list(stdlib_sources(200_000))), qwen2(), prefix)
    return str(prefix)


@pytest.fixture(scope="session")
def qwen2_tokenizer_dir(tmp_path_factory):
    """A Hugging Face tokenizer directory (tokenizer.json + ChatML template) for the real Qwen2
    vocabulary, exported offline from the BPE ranks in the dashscope wheel."""
    from ray_ppu.data.tokenizer import export_qwen2_tokenizer

    return export_qwen2_tokenizer(tmp_path_factory.mktemp("qwen2_hf") / "tokenizer")


@pytest.fixture(scope="session")
def tiny_llava_dir(tmp_path_factory, qwen2_tokenizer_dir):
    """tiny-vl as a Hugging Face LLaVA directory (SigLIP + Qwen2 with the real vocabulary,
    random weights), with its tokenizer and image processor beside it."""
    import shutil

    import torch
    from transformers import (LlavaConfig, LlavaForConditionalGeneration, Qwen2Config,
                              SiglipImageProcessor, SiglipVisionConfig)

    path = tmp_path_factory.mktemp("tiny_llava") / "tiny-llava"
    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=32, patch_size=8)
    text = Qwen2Config(vocab_size=151_936, hidden_size=64, intermediate_size=176,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       max_position_embeddings=32_768, rms_norm_eps=1e-6, rope_theta=1e6,
                       tie_word_embeddings=True)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_id=151_655,
                         vision_feature_layer=-1, vision_feature_select_strategy="full",
                         tie_word_embeddings=True)
    LlavaForConditionalGeneration(config).save_pretrained(path)
    SiglipImageProcessor(size={"height": 32, "width": 32}).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(qwen2_tokenizer_dir) / name, path / name)
    return path


def random_qwen_vl(path: Path, *, vocab: int = 151_936, text_layers: int = 2,
                   tower_layers: int = 4, full_attention: tuple = (1, 3), tied: bool = True,
                   sharp: bool = False, published_names: bool = False,
                   ids: tuple = (151_655, 151_652, 151_656)):
    """A random tiny Qwen2.5-VL (tiny-qwen-vl's shape: width 64, M-RoPE [2, 3, 3], a tower of
    width 32 with 56-pixel windows) saved to ``path``; the model back. ``sharp``: norms and
    biases drawn at random and attention weights drawn wide, so that positions and mix-ups
    move the logits (~0.1 for plain positions instead of M-RoPE's; 1e-4 at transformers'
    0.02). ``published_names``: tensors spelled as the published checkpoints (``model.…``,
    ``visual.…``), not as transformers 5 saves them. ``ids``: <|image_pad|>, <|vision_start|>
    (<|vision_end|> the next) and <|video_pad|>, Qwen2's by default."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen2_5_VLConfig(
        text_config=dict(vocab_size=vocab, hidden_size=64, intermediate_size=176,
                         num_hidden_layers=text_layers, num_attention_heads=4,
                         num_key_value_heads=2, max_position_embeddings=32_768, rms_norm_eps=1e-6,
                         rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3],
                                          "rope_theta": 1e6}),
        vision_config=dict(depth=tower_layers, hidden_size=32, intermediate_size=48, num_heads=2,
                           out_hidden_size=64, fullatt_block_indexes=list(full_attention),
                           window_size=56),
        image_token_id=ids[0], vision_start_token_id=ids[1], vision_end_token_id=ids[1] + 1,
        video_token_id=ids[2], tie_word_embeddings=tied)
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    if sharp:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name or "ln_q" in name or name.endswith("bias"):
                    param.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
                elif name.endswith(("q_proj.weight", "k_proj.weight", "attn.qkv.weight")):
                    param.normal_(0.0, 0.3)
    model.save_pretrained(path)
    if published_names:  # model.language_model.X → model.X, model.visual.X → visual.X
        tensors = load_file(path / "model.safetensors")
        save_file({n.replace("model.language_model.", "model.").replace("model.visual.", "visual.")
                   : t for n, t in tensors.items()}, path / "model.safetensors",
                  metadata={"format": "pt"})
    return model


def qwen_vl_reference(model, ids, pixels, grid, image_id: int) -> dict:
    """What transformers' Qwen2.5-VL ``model`` makes of one prompt ``ids`` [1, n] with its
    images (processor's pixel values and grids): the ids, images, M-RoPE positions
    (``get_rope_index``) and logits the tests compare ray_ppu with."""
    import torch

    with torch.no_grad():
        mm_types = (ids == image_id).int()
        positions, _ = model.model.get_rope_index(ids, mm_token_type_ids=mm_types,
                                                  image_grid_thw=grid)
        logits = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid,
                       mm_token_type_ids=mm_types).logits[0]
    return {"ids": ids[0].tolist(), "pixels": pixels, "grid": grid,
            "positions": positions[:, 0], "logits": logits}


@pytest.fixture(scope="session")
def tiny_qwen_vl_dir(tmp_path_factory, qwen2_tokenizer_dir):
    """tiny-qwen-vl as a Hugging Face Qwen2.5-VL directory (the real Qwen2 vocabulary, random
    weights, images of 56² … 112² pixels: 4 … 16 tokens), with its tokenizer and image
    processor beside it."""
    import shutil

    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    path = tmp_path_factory.mktemp("tiny_qwen_vl") / "tiny-qwen-vl"
    random_qwen_vl(path)  # Qwen2's ids: <|image_pad|> 151655, <|vision_start|> 151652
    Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(Path(qwen2_tokenizer_dir) / name, path / name)
    return path


@pytest.fixture(scope="session")
def uninterrupted(prelaunched):
    """The checkpoint and fault tests' reference run (DP 2, saving every 4, nothing going
    wrong), which the training tests also compare with DP 1: one run for all of them
    (test_checkpoint ``run_uninterrupted``, prelaunched)."""
    return prelaunched.result("uninterrupted")
