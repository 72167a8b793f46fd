"""A grammar compile's first run, in a child process that can be stopped.

The backends' compilers (C++/Rust) cannot be interrupted and bound neither their time nor
their memory. ``CompileWorker`` keeps one long-lived child (``python -m`` this module) that
builds the same backend from the tokenizer's directory; each spec is first *probed* there:
compiled, a matcher made, its initial mask filled, its jump-forward string found and its
first decode steps timed against the step budget (``probe.probe``). The child's address
space is limited (RLIMIT_AS: what it had after start-up plus ``memory_mb``) and the parent
also watches its RSS; past either limit, or past ``timeout_s``, the parent kills it and
the spec is refused with a ValueError naming the limit and its flag; a fresh child starts
for the next spec. Compiling is deterministic, so the scheduler's own compile of a spec
that passed stays within the same bounds.

Frames on the child's stdin/stdout: a 4-byte big-endian length, then msgpack (msgspec
structs; never pickle). The child's own stdout is moved to stderr so a library's prints
cannot corrupt the stream.
"""

from __future__ import annotations

import logging
import os
import resource
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any

import msgspec

from radixlm.runtime.parent_death import die_with_parent

logger = logging.getLogger(__name__)

MAX_FRAME = 1 << 30  # an exported grammar is bounded by the child's memory limit
STARTUP_TIMEOUT_S = 300.0  # importing the backend and loading the tokenizer
_POLL_S = 0.02


class WorkerConfig(msgspec.Struct, frozen=True):
    backend: str
    tokenizer_path: str
    vocab_size: int
    stop_token_ids: list[int]
    memory_mb: int
    delay_s: float = 0.0  # tests: every probe sleeps first (the time limit, never a slow box)
    alloc_mb: int = 0  # tests: every probe allocates this much first (the memory limit)
    step_budget_ms: float = 0.0  # --grammar-step-budget-ms: the first steps' cost (0: none)
    step_delay_s: float = 0.0  # tests: every probed decode step sleeps first (the budget)


class ProbeRequest(msgspec.Struct, frozen=True):
    kind: str
    spec: str


class ProbeReply(msgspec.Struct, frozen=True):
    error: str | None = None
    # the compiled grammar as plain data (GrammarBackend.export), when the backend can
    # rebuild it from that cheaply: the parent then does not compile it again
    payload: Any = None


def write_frame(out: IO[bytes], payload: bytes) -> None:
    out.write(struct.pack(">I", len(payload)) + payload)
    out.flush()


def read_frame(inp: IO[bytes]) -> bytes:
    head = inp.read(4)
    if len(head) < 4:
        raise EOFError
    (size,) = struct.unpack(">I", head)
    if size > MAX_FRAME:
        raise ValueError(f"frame of {size} bytes (limit {MAX_FRAME})")
    body = inp.read(size)
    if len(body) < size:
        raise EOFError
    return body


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _vm_size() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _serve(config: WorkerConfig, inp: IO[bytes], out: IO[bytes]) -> None:
    from radixlm.runtime.constrained import create_grammar_backend
    from radixlm.runtime.constrained.base import canonical_spec
    from radixlm.runtime.constrained.probe import probe
    from radixlm.runtime.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.tokenizer_path)
    backend = create_grammar_backend(config.backend, tokenizer, config.vocab_size,
                                     config.stop_token_ids)
    limit = _vm_size() + (config.memory_mb << 20)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    write_frame(out, msgspec.msgpack.encode(ProbeReply()))  # ready
    decoder = msgspec.msgpack.Decoder(ProbeRequest)
    while True:
        req = decoder.decode(read_frame(inp))
        if config.delay_s:
            time.sleep(config.delay_s)
        ballast = bytearray(config.alloc_mb << 20) if config.alloc_mb else None
        try:
            grammar = backend.compile(req.kind, canonical_spec(req.kind, req.spec))
            probe(grammar, req.kind, backend.vocab_size, backend.stop_token_ids, tokenizer,
                  config.step_budget_ms, config.step_delay_s)
            reply = ProbeReply(payload=backend.export(grammar))
        except ValueError as e:
            reply = ProbeReply(error=str(e))
        except MemoryError:
            reply = ProbeReply(error="memory")
        except RuntimeError as e:  # xgrammar's C++ errors, std::bad_alloc among them
            reply = ProbeReply(error="memory" if "bad_alloc" in str(e)
                               else f"grammar compilation failed: {e}")
        del ballast
        write_frame(out, msgspec.msgpack.encode(reply))


def main() -> None:
    """The child: argv[1] is the parent's pid (it dies with it, even SIGKILLed)."""
    die_with_parent(int(sys.argv[1]))
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # library prints go to stderr, never into the frames
    inp = sys.stdin.buffer
    try:
        config = msgspec.msgpack.decode(read_frame(inp), type=WorkerConfig)
        _serve(config, inp, out)
    except (EOFError, BrokenPipeError):
        pass  # the parent closed the pipe: its compiler shut down


# The child's first lines, before `import radixlm` (seconds of imports): it dies with its
# parent from the start (PR_SET_PDEATHSIG; die_with_parent in main checks the pid again).
_BOOTSTRAP = ("import ctypes, os, signal, sys\n"
              "ctypes.CDLL(None).prctl(1, signal.SIGKILL, 0, 0, 0)\n"
              "if os.getppid() != int(sys.argv[1]):\n"
              "    os._exit(1)\n"
              "from radixlm.runtime.constrained.compile_worker import main\n"
              "main()\n")


class WorkerDied(Exception):
    """The child ended or was killed; ``reason`` says which limit (or none)."""


class CompileWorker:
    """The parent's side: one child at a time, started on first use and after each kill.
    Not thread-safe: the GrammarCompiler calls it from its one probe thread."""

    def __init__(self, config: WorkerConfig, timeout_s: float) -> None:
        self.config, self.timeout_s = config, timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._base_rss = 0
        self.kills = 0

    def probe(self, kind: str, spec: str) -> tuple[str | None, Any]:
        """The child's verdict on ``spec``: (None, its export) if it compiled within the
        limits, else (the reason: a ValueError's message, or the limit reached, None)."""
        proc = self.ensure_started()
        try:
            write_frame(proc.stdin, msgspec.msgpack.encode(ProbeRequest(kind, spec)))  # type: ignore[arg-type]
            reply = self._await_reply(time.monotonic() + self.timeout_s, watch=True)
        except BrokenPipeError:
            self.kill()
            return self._memory_message(), None
        except WorkerDied as e:
            return str(e), None
        if reply.error is not None and (reply.error == "memory" or "bad_alloc" in reply.error):
            return self._memory_message(), None
        return reply.error, reply.payload

    def ensure_started(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _BOOTSTRAP, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=os.environ.copy())
        write_frame(self._proc.stdin, msgspec.msgpack.encode(self.config))  # type: ignore[arg-type]
        try:
            self._await_reply(time.monotonic() + STARTUP_TIMEOUT_S, watch=False)
        except WorkerDied as e:
            raise RuntimeError(f"the grammar compile worker did not start: {e}") from None
        self._base_rss = rss_bytes(self._proc.pid)
        return self._proc

    def _await_reply(self, deadline: float, watch: bool) -> ProbeReply:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        while True:
            ready, _, _ = select.select([fd], [], [], _POLL_S)
            if ready:
                try:
                    return msgspec.msgpack.decode(read_frame(proc.stdout), type=ProbeReply)
                except EOFError:
                    self.kill()
                    raise WorkerDied(self._memory_message() if watch else "it exited"
                                     ) from None
            if time.monotonic() > deadline:
                self.kill()
                raise WorkerDied(self._time_message())
            if watch and rss_bytes(proc.pid) - self._base_rss > self.config.memory_mb << 20:
                self.kill()
                raise WorkerDied(self._memory_message())

    def _memory_message(self) -> str:
        return (f"grammar compilation exceeded the memory limit of {self.config.memory_mb} MB "
                "(--grammar-compile-memory-mb)")

    def _time_message(self) -> str:
        return (f"grammar compilation exceeded the time limit of {self.timeout_s} s "
                "(--grammar-compile-timeout)")

    def kill(self) -> None:
        """Stop the child (a fresh one starts on the next probe)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        self.kills += 1 if proc.poll() is None else 0
        proc.kill()
        proc.wait()
        for pipe in (proc.stdin, proc.stdout):
            try:
                if pipe is not None:
                    pipe.close()
            except OSError:
                pass


if __name__ == "__main__":
    main()
