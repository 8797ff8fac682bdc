"""llama.cpp as a benchmark peer: the vendored llama.cpp of the pinned llama-cpp-python sdist,
built once into a cache, run on deepwell's embedded GGUF (the very same Q4_1 weights).

`ensure_llama_cpp` downloads the sdist (from the package registry, the only step that needs
the network), applies PATCHES (a miscompile of llama.cpp's AMX path by gcc 12) and builds
`llama-bench`, `llama-server` and `llama-batched-bench` (about 15 minutes on 2 cores; a build
from before a patch rebuilds only what it touches); `find_llama_cpp` only looks. `tg128` is
llama-bench's batch-1 decode figure; `batched_decode` is llama-batched-bench's decode tok/s at several batch sizes; `serve_w`
submits workload W (benchmarks/workload.py) at t = 0 to `llama-server -np 16`
(continuous batching, no prompt cache) as token ids and reports output tok/s over wall time,
as benchmarks/throughput_vs_hf.py does. As a script: tg128 (and pp, with --n-prompt) at each
of --threads, with the weights repacked (llama.cpp's default: on an AMX CPU its AMX tile
kernels for prompts, VNNI for one row) and in plain buffers, then W at the largest, with the
CPU's SIMD flags and llama.cpp's build.

    .venv/bin/python benchmarks/llama_cpp_peer.py [--threads 1,2] [--repetitions 5]
        [--n-prompt 64] [--no-serve] [--cache-dir DIR] [--json out.json]
"""

import argparse
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TextIO

# llama.cpp comes from this sdist, not from a Python dependency: it is built from source
# with the CPU's own instruction set (GGML_NATIVE), as a user who picks it would.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
SDIST_DIR = f"llama_cpp_python-{LLAMA_CPP_PYTHON_VERSION}"
CACHE_DIR = Path.home() / ".cache" / "deepwell" / f"llama.cpp-{LLAMA_CPP_PYTHON_VERSION}"
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DGGML_NATIVE=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
)
TARGETS = ("llama-bench", "llama-server", "llama-batched-bench")
# In the build's bin directory: the names of the PATCHES it was built with, one a line.
PATCHES_STAMP = "deepwell-patches"
BUILD_TOOLS = ("cmake", "make", "cc", "c++")
# Issue 16: llama.cpp's tg128 on this GGUF with 2 threads, on the issue author's machine.
QUOTED_TG128_2_THREADS = (151.0, 166.0)
# The SIMD flags that decide llama.cpp's (and torch's) kernels, x86 and Arm.
SIMD_FLAG_PREFIXES = ("sse", "ssse", "avx", "amx", "fma", "f16c", "asimd", "sve", "bf16", "i8mm")


class LlamaCppError(RuntimeError):
    """llama.cpp could not be built or run; the message says what to do."""


@dataclass(frozen=True)
class SourcePatch:
    """One fix to the vendored llama.cpp, made before it is built: `old` becomes `new` in
    `path` (relative to the llama.cpp source), where `old` must occur exactly once."""

    name: str
    path: str
    old: str
    new: str


PATCHES = (
    # gcc 12's _tile_loadconfig (amxtileintrin.h) hands `ldtilecfg` only the first 8 bytes of
    # the 64-byte tile configuration as its memory operand, so gcc drops the stores of the
    # tiles' rows and bytes per row as dead: llama.cpp's AMX matmul loads palette 1 with every
    # tile unconfigured, and its first `tileloadd` dies of SIGILL (any prompt of 2+ tokens on
    # repacked weights, its default on an AMX CPU). The operand naming the whole struct keeps
    # the stores, as gcc 13's header does through a builtin.
    SourcePatch(
        name="amx-whole-tile-config",
        path="ggml/src/ggml-cpu/amx/mmq.cpp",
        old="    _tile_loadconfig(&tc);\n",
        new='    __asm__ volatile("ldtilecfg %0" : : "m"(tc));\n',
    ),
)


@dataclass(frozen=True)
class LlamaCpp:
    bin_dir: Path

    @property
    def bench(self) -> Path:
        return self.bin_dir / "llama-bench"

    @property
    def server(self) -> Path:
        return self.bin_dir / "llama-server"

    @property
    def batched_bench(self) -> Path:
        return self.bin_dir / "llama-batched-bench"


@dataclass(frozen=True)
class BenchResult:
    """One llama-bench test: pp<n> (prompt processing) or tg<n> (decode, batch 1)."""

    test: str
    n_threads: int
    # Weights in llama.cpp's "extra" buffers (on an AMX CPU its AMX/VNNI Q4_1 kernels).
    repack: bool
    tok_s: float
    stddev_tok_s: float
    samples_tok_s: tuple[float, ...]
    cpu_info: str
    build_commit: str


@dataclass(frozen=True)
class BatchedDecode:
    """One llama-batched-bench row: `batch` sequences of `prompt` tokens each, then `tokens`
    decode steps of all of them together."""

    batch: int
    prompt: int
    tokens: int
    n_threads: int
    repack: bool
    # batch * tokens / the decode steps' seconds.
    tok_s: float


@dataclass(frozen=True)
class ServeResult:
    requests: int
    output_tokens: int
    seconds: float

    @property
    def output_tok_s(self) -> float:
        return self.output_tokens / self.seconds


# ---- build ----


def source_dir(cache_dir: Path) -> Path:
    return cache_dir / SDIST_DIR / "vendor" / "llama.cpp"


def find_llama_cpp(cache_dir: Path = CACHE_DIR) -> LlamaCpp | None:
    """The build in `cache_dir` if every target's binary is there, built with every one of
    PATCHES; never builds."""
    llama = LlamaCpp(source_dir(cache_dir) / "build" / "bin")
    ready = all(os.access(llama.bin_dir / target, os.X_OK) for target in TARGETS)
    stamp = llama.bin_dir / PATCHES_STAMP
    patched = stamp.is_file() and stamp.read_text().split() == [p.name for p in PATCHES]
    return llama if ready and patched else None


def describe(llama: LlamaCpp) -> str:
    """Which llama.cpp build runs, for a benchmark's output."""
    patches = ", ".join(patch.name for patch in PATCHES)
    return (
        f"llama.cpp of llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, GGML_NATIVE, patched"
        f" ({patches}), in {llama.bin_dir}"
    )


def missing_build(cache_dir: Path) -> str:
    """What to do when find_llama_cpp finds no build in `cache_dir`."""
    return (
        f"no patched llama.cpp build in {cache_dir}: run benchmarks/llama_cpp_peer.py (it"
        " builds one, ~15 min; over a build from before PATCHES, seconds)"
    )


def apply_patches(source: Path) -> None:
    """Makes each of PATCHES in the llama.cpp source at `source`; one already made is left."""
    for patch in PATCHES:
        path = source / patch.path
        text = path.read_text()
        if patch.new in text:
            continue
        if text.count(patch.old) != 1:
            raise LlamaCppError(
                f"{path} does not hold the line patch {patch.name} replaces"
                f" ({patch.old.strip()!r}); was the sdist changed?"
            )
        path.write_text(text.replace(patch.old, patch.new))


def ensure_llama_cpp(cache_dir: Path = CACHE_DIR, log: Callable[[str], None] = print) -> LlamaCpp:
    """The build in `cache_dir`, downloading the sdist and building it first if absent."""
    found = find_llama_cpp(cache_dir)
    if found is not None:
        return found
    missing = [tool for tool in BUILD_TOOLS if shutil.which(tool) is None]
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {', '.join(missing)} on PATH "
            "(Debian/Ubuntu: apt-get install cmake make g++)"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    source = source_dir(cache_dir)
    if not source.is_dir():
        sdist = download_sdist(cache_dir, log)
        log(f"unpacking {sdist.name}")
        with tarfile.open(sdist) as archive:
            archive.extractall(cache_dir, filter="data")
        if not source.is_dir():
            raise LlamaCppError(f"{sdist} holds no {source.relative_to(cache_dir)}")
    apply_patches(source)
    build_log = cache_dir / "build.log"
    log(
        f"building {', '.join(TARGETS)} in {source / 'build'} (about 15 minutes on 2 cores"
        f" from scratch; full log: {build_log})"
    )
    start = time.perf_counter()
    with build_log.open("w") as log_file:
        run_logged(["cmake", "-B", "build", *CMAKE_OPTIONS], source, log_file, log)
        jobs = f"-j{os.cpu_count() or 1}"
        run_logged(["cmake", "--build", "build", jobs, "--target", *TARGETS], source, log_file, log)
    stamp = source / "build" / "bin" / PATCHES_STAMP
    stamp.write_text("".join(f"{patch.name}\n" for patch in PATCHES))
    found = find_llama_cpp(cache_dir)
    if found is None:
        raise LlamaCppError(
            f"the build finished without all of {', '.join(TARGETS)}; see {build_log}"
        )
    log(f"built llama.cpp in {time.perf_counter() - start:.0f} s")
    return found


def download_sdist(cache_dir: Path, log: Callable[[str], None]) -> Path:
    archives = sorted(cache_dir.glob(f"{SDIST_DIR}.tar.gz"))
    if archives:
        return archives[0]
    requirement = f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}"
    log(f"downloading the {requirement} sdist into {cache_dir}")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    if subprocess.run([*command, requirement, "-d", str(cache_dir)]).returncode:
        raise LlamaCppError(
            f"pip could not download {requirement}: the package index must be reachable once,"
            f" at setup (or put {SDIST_DIR}.tar.gz into {cache_dir})"
        )
    archives = sorted(cache_dir.glob(f"{SDIST_DIR}.tar.gz"))
    if not archives:
        raise LlamaCppError(f"pip downloaded no {SDIST_DIR}.tar.gz into {cache_dir}")
    return archives[0]


def run_logged(command: list[str], cwd: Path, log_file: TextIO, log: Callable[[str], None]) -> None:
    """Runs a build step into the log, showing only its progress lines ("[ 56%] Building …")."""
    log_file.write(f"$ {' '.join(command)}\n")
    process = subprocess.Popen(
        command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    tail: list[str] = []
    for line in process.stdout:
        log_file.write(line)
        tail = [*tail[-29:], line.rstrip()]
        if line.startswith("[") and "%]" in line[:7]:
            log(line.rstrip())
    if process.wait():
        raise LlamaCppError(
            f"`{' '.join(command)}` failed (exit {process.returncode}) in {cwd}; it needs cmake"
            " >= 3.14 and a C++17 compiler (apt-get install cmake make g++). Its last lines:\n"
            + "\n".join(tail)
        )


# ---- llama-bench ----


def model_path() -> Path:
    from deepwell.engine.models.loader import embedded_model_path

    return embedded_model_path()


def llama_bench_command(
    llama: LlamaCpp,
    model: Path,
    threads: int,
    n_prompt: int,
    n_gen: int,
    repetitions: int,
    repack: bool = True,
) -> list[str]:
    # -p and -n are separate tests (pp<n_prompt>, tg<n_gen>); -p 0 leaves only tg.
    return [
        str(llama.bench),
        *("-m", str(model), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen)),
        *("--repack", str(int(repack)), "-r", str(repetitions), "-o", "json"),
    ]


def parse_llama_bench(text: str) -> list[BenchResult]:
    """llama-bench's `-o json` output: one object per test."""
    results = []
    for test in json.loads(text):
        n_prompt, n_gen = test["n_prompt"], test["n_gen"]
        name = (f"pp{n_prompt}" if n_prompt else "") + ("+" if n_prompt and n_gen else "")
        name += f"tg{n_gen}" if n_gen else ""
        results.append(
            BenchResult(
                test=name,
                n_threads=test["n_threads"],
                repack=test["repack"],
                tok_s=test["avg_ts"],
                stddev_tok_s=test["stddev_ts"],
                samples_tok_s=tuple(test["samples_ts"]),
                cpu_info=test["cpu_info"],
                build_commit=test["build_commit"],
            )
        )
    return results


def llama_bench(
    llama: LlamaCpp,
    threads: int,
    n_prompt: int = 0,
    n_gen: int = 128,
    repetitions: int = 5,
    repack: bool = True,
) -> list[BenchResult]:
    model = model_path()
    command = llama_bench_command(llama, model, threads, n_prompt, n_gen, repetitions, repack)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        tail = "\n".join(result.stderr.strip().splitlines()[-10:])
        raise LlamaCppError(f"llama-bench failed (exit {result.returncode}):\n{tail}")
    return parse_llama_bench(result.stdout)


def tg128(llama: LlamaCpp, threads: int, repetitions: int = 5) -> BenchResult:
    """Batch-1 decode tok/s of 128 tokens (mean and stddev over `repetitions`), llama.cpp's
    defaults: on an AMX CPU its decode (one row) takes the AMX buffers' VNNI kernel, 2x
    the plain buffers' speed on the Xeon of docs/benchmarks.md."""
    (result,) = llama_bench(llama, threads, n_prompt=0, n_gen=128, repetitions=repetitions)
    return result


# ---- llama-batched-bench: decode at several batch sizes ----


def batched_bench_command(
    llama: LlamaCpp,
    model: Path,
    threads: int,
    prompt: int,
    tokens: int,
    batches: list[int],
    repack: bool,
) -> list[str]:
    # Each sequence has its own prompt (no -pps) and its whole context in the cache.
    context = -(-max(batches) * (prompt + tokens) // 256) * 256
    command = [
        str(llama.batched_bench),
        *("-m", str(model), "-t", str(threads), "-c", str(context), "-b", "2048", "-ub", "512"),
        *("-npp", str(prompt), "-ntg", str(tokens), "-npl", ",".join(map(str, batches))),
        *("--output-format", "jsonl"),
    ]
    return command if repack else [*command, "--no-repack"]


def parse_batched_bench(text: str, repack: bool) -> list[BatchedDecode]:
    """llama-batched-bench's jsonl rows (its log lines around them skipped)."""
    rows = []
    for line in text.splitlines():
        if not line.startswith("{"):
            continue
        row = json.loads(line)
        rows.append(
            BatchedDecode(
                batch=row["pl"],
                prompt=row["pp"],
                tokens=row["tg"],
                n_threads=row["n_threads"],
                repack=repack,
                tok_s=row["speed_tg"],
            )
        )
    return rows


def batched_decode(
    llama: LlamaCpp,
    threads: int,
    batches: list[int],
    prompt: int = 64,
    tokens: int = 128,
    repack: bool = True,
) -> list[BatchedDecode]:
    """Decode tok/s at each batch size, the weights repacked (llama.cpp's default) or in plain
    buffers; its batch-1 best is tg128."""
    model = model_path()
    command = batched_bench_command(llama, model, threads, prompt, tokens, batches, repack)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        tail = "\n".join(result.stderr.strip().splitlines()[-10:])
        raise LlamaCppError(f"llama-batched-bench failed (exit {result.returncode}):\n{tail}")
    return parse_batched_bench(result.stdout, repack)


# ---- llama-server on W ----


def slot_context(workload: list[dict]) -> int:
    # Every slot holds its longest request whole (no context shift), rounded up to the
    # 256-token multiple llama.cpp pads its context to, so -c / -np is not cut below it.
    longest = max(r["prompt_len"] + r["output_len"] for r in workload)
    return -(-longest // 256) * 256


def llama_server_command(
    llama: LlamaCpp, model: Path, threads: int, parallel: int, context: int
) -> list[str]:
    return [
        str(llama.server),
        *("-m", str(model), "-t", str(threads), "-tb", str(threads)),
        # -np slots share the batch each step: continuous batching, as deepwell runs W.
        *("-np", str(parallel), "-c", str(context), "--cont-batching"),
        # W's prompts share no prefix; no prompt cache, in the slots or in RAM, so a
        # request never starts from an earlier one's KV (deepwell runs W without it too).
        *("--no-cache-prompt", "--cache-ram", "0", "--no-webui"),
        # The weights stay repacked (llama.cpp's default; on an AMX CPU its AMX tile kernels,
        # see PATCHES), its fastest configuration on the Xeon of docs/benchmarks.md.
    ]


def completion_body(prompt_ids: list[int], output_len: int) -> dict:
    return {
        "prompt": prompt_ids,
        "n_predict": output_len,
        "ignore_eos": True,
        "temperature": 0,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": False,
    }


def check_completion(response: dict, output_len: int) -> None:
    """A W request counts only when it generated exactly its `output_len` tokens."""
    generated = response.get("tokens_predicted")
    tokens = response.get("tokens") or []
    if generated != output_len or len(tokens) != output_len:
        raise LlamaCppError(
            f"llama-server generated {generated} tokens ({len(tokens)} returned) for a request"
            f" of {output_len} (stop: {response.get('stop_type')})"
        )


def post_json(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as error:
        raise LlamaCppError(
            f"llama-server answered {error.code}: {error.read()[:500]!r}"
        ) from error


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    # A benchmark child killed on timeout (SIGKILL: no cleanup runs) must not leave its
    # llama-server running on the shared cores.
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class LlamaServer:
    """A running llama-server on loopback, stopped on exit; its log goes to `log_path`.
    A subclass serves another HTTP server the same way (its name, readiness path, patience)."""

    name = "llama-server"
    # 503 while the model loads, 200 once the slots are up.
    ready_path = "/health"
    ready_timeout = 120.0
    # SIGTERM first; SIGKILL after this long.
    stop_timeout = 15.0

    def __init__(self, command: list[str], log_path: Path) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = log_path
        self.command = [*command, "--host", "127.0.0.1", "--port", str(port)]

    def __enter__(self) -> "LlamaServer":
        self._log = self.log_path.open("w")
        self.process = subprocess.Popen(
            self.command,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent if sys.platform == "linux" else None,
        )
        try:
            self.wait_ready(timeout=self.ready_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def log_tail(self) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-15:])

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise LlamaCppError(
                    f"{self.name} exited ({self.process.returncode}) before it was ready:\n"
                    + self.log_tail()
                )
            try:
                with urllib.request.urlopen(f"{self.url}{self.ready_path}", timeout=2) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        raise LlamaCppError(f"{self.name} not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def serve_w(llama: LlamaCpp, threads: int, workload: list[dict], parallel: int = 16) -> ServeResult:
    """All of `workload` submitted at t = 0 to llama-server; output tok/s over wall time."""
    model = model_path()
    context = parallel * slot_context(workload)
    command = llama_server_command(llama, model, threads, parallel, context)
    with (
        tempfile.TemporaryDirectory() as scratch,
        LlamaServer(command, Path(scratch) / "llama-server.log") as server,
    ):
        url = f"{server.url}/completion"
        # One short request first, as deepwell's runs warm up before the clock starts.
        warm = workload[0]["prompt_ids"][:64]
        check_completion(post_json(url, completion_body(warm, 8), timeout=120), 8)

        def one(request: dict) -> None:
            body = completion_body(request["prompt_ids"], request["output_len"])
            check_completion(post_json(url, body, timeout=1800), request["output_len"])

        # Not a `with`: on an error or SIGTERM the server must stop (failing the requests still
        # in flight) before anything waits for the request threads.
        pool = ThreadPoolExecutor(max_workers=len(workload))
        try:
            start = time.perf_counter()
            list(pool.map(one, workload))
            seconds = time.perf_counter() - start
        finally:
            pool.shutdown(wait=False, cancel_futures=True)
    return ServeResult(len(workload), sum(r["output_len"] for r in workload), seconds)


# ---- script ----


def simd_flags() -> list[str]:
    """The CPU's SIMD flags, from `lscpu` (or /proc/cpuinfo where lscpu is missing)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        text = Path("/proc/cpuinfo").read_text()
    for line in text.splitlines():
        if line.split(":")[0].strip().lower() in ("flags", "features"):
            words = line.split(":", 1)[1].split()
            return sorted({word for word in words if word.startswith(SIMD_FLAG_PREFIXES)})
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--threads",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 2],
        help="llama.cpp threads, comma-separated; W runs at the largest",
    )
    parser.add_argument("--repetitions", type=int, default=5, help="llama-bench -r")
    parser.add_argument(
        "--n-prompt", type=int, default=0, help="also llama-bench's pp<N> (prompt processing)"
    )
    parser.add_argument("--no-serve", dest="serve", action="store_false", help="skip W")
    parser.add_argument("--parallel", type=int, default=16, help="llama-server -np")
    parser.add_argument("--cache-dir", type=Path, default=CACHE_DIR, help="where it is built")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    # Stopped with SIGTERM, the script still stops its llama-server (the `with` exits).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped (SIGTERM)"))

    try:
        llama = ensure_llama_cpp(args.cache_dir)
    except LlamaCppError as error:
        sys.exit(str(error))
    print(f"{describe(llama)}; SIMD flags: {' '.join(simd_flags())}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}", flush=True)
    summary: dict = {"simd_flags": simd_flags(), "bench": [], "load_average": os.getloadavg()[0]}
    for threads in args.threads:
        # Both weight layouts, so the output shows llama.cpp's default is its fastest here.
        results = [
            result
            for repack in (True, False)
            for result in llama_bench(
                llama, threads, args.n_prompt, 128, args.repetitions, repack=repack
            )
        ]
        for result in results:
            summary["bench"].append(asdict(result))
            print(
                f"{result.test}, {threads} threads, repack {'on' if result.repack else 'off'}:"
                f" {result.tok_s:.1f} ± {result.stddev_tok_s:.1f} tok/s ({result.cpu_info},"
                f" build {result.build_commit}; load average {os.getloadavg()[0]:.2f})",
                flush=True,
            )
    if args.serve:
        from throughput_vs_hf import load_workload

        workload, sha = load_workload()
        threads = max(args.threads)
        print(f"W (sha256 {sha[:16]}…) through llama-server -np {args.parallel} …", flush=True)
        served = serve_w(llama, threads, workload, args.parallel)
        summary["w"] = asdict(served) | {
            "output_tok_s": served.output_tok_s,
            "threads": threads,
            "parallel": args.parallel,
        }
        print(
            f"W, {threads} threads, -np {args.parallel}: {served.seconds:.1f} s,"
            f" {served.output_tok_s:.1f} output tok/s (load average {os.getloadavg()[0]:.2f})"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
