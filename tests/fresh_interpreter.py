"""Fresh processes for the suite without paying their imports each time: a fork server ("zygote") that has imported
torch, transformers, PEFT and Lightning once, and forks a child per program.

Why: every fresh Python process here spends 10–13 s importing transformers and PEFT (bitsandbytes imports
``torch._inductor``), and the round-trip tests (save in the suite, load in a new process) start several of them.
What the tests prove with a new process is that nothing of *this* library is loaded or registered there: the
zygote imports third-party packages only, checks at start-up that none of ours is in ``sys.modules``, and each child
runs its program as ``__main__`` in a process of its own (own pid, own environment, cwd, argv, stdout/stderr files;
it can be signalled and killed). Tests of what a bare interpreter imports (import purity) must not use it: the
preloaded packages are already in its ``sys.modules``.

The zygote never runs a torch computation before forking, so no OpenMP thread pool exists to be lost by the fork.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

#: Third-party packages the zygote imports before forking (what a fresh process of these tests spends its time on).
PRELOAD = ("torch", "numpy", "safetensors", "transformers", "peft", "lightning", "jsonargparse", "yaml")

#: Top-level packages of this library: never in the zygote (a child must import and register them itself).
FIRST_PARTY = ("peftplug", "peftplug_kernels", "oftv2", "helene", "prompt_transfer", "steering")

_SERVER = r'''
import atexit, json, os, runpy, sys, tempfile, traceback
preload, first_party = json.loads(sys.argv[1]), tuple(json.loads(sys.argv[2]))
for name in preload:
    __import__(name)
loaded = sorted(m for m in sys.modules if m.split(".")[0] in first_party)
assert not loaded, f"the zygote imported this library: {loaded}"
base_path = [p for p in sys.path if p and p not in os.environ.get("PYTHONPATH", "").split(os.pathsep)]
replies = os.fdopen(os.dup(1), "w")
print(json.dumps({"ready": os.getpid()}), file=replies, flush=True)

def child(req):
    replies.close()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    os.environ.clear()
    os.environ.update(req["env"])
    # The preloaded packages made tempfile settle on the server's temporary folder: the child reads its own TMPDIR,
    # as a new interpreter would.
    tempfile.tempdir = None
    os.chdir(req["cwd"])
    script = req["script"]
    extra = [p for p in req["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:] = [os.path.dirname(os.path.abspath(script)), *extra, *base_path]
    sys.argv = [script, *req["argv"]]
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # what a normal interpreter exit runs
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        child(req)
    print(json.dumps({"pid": pid}), file=replies, flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"pid": pid, "returncode": os.waitstatus_to_exitcode(status)}), file=replies, flush=True)
'''


class ForkedProcess:
    """A program running in a child of the zygote, with the parts of :class:`subprocess.Popen` the tests use.

    Args:
        zygote: The server that forked it.
        pid: The child's process id.
        stdout: File its standard output goes to.
        stderr: File its standard error goes to.
    """

    def __init__(self, zygote: Zygote, pid: int, stdout: Path, stderr: Path) -> None:
        self.zygote, self.pid, self.stdout_path, self.stderr_path = zygote, pid, stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit status if the child has ended (negative: killed by that signal), else ``None``."""
        if self.returncode is None:
            self._record(self.zygote.reply(timeout=0))
        return self.returncode

    def _record(self, reply: dict | None) -> None:
        """Takes the server's "child ended" reply, if one came; the server is then free for the next child."""
        if reply is not None:
            self.returncode = reply["returncode"]
            self.zygote.busy = False

    def send_signal(self, sig: int) -> None:
        """Sends ``sig`` to the child.

        Args:
            sig: A signal number.
        """
        if self.poll() is None:
            os.kill(self.pid, sig)

    def wait(self, timeout: float | None = None) -> int:
        """Waits for the child to end; kills it and raises :class:`subprocess.TimeoutExpired` after ``timeout`` s.

        Args:
            timeout: Seconds to wait, or ``None`` for no limit.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                os.kill(self.pid, signal.SIGKILL)
                self.wait()
                raise subprocess.TimeoutExpired(f"forked child {self.pid}", timeout)
            self._record(self.zygote.reply(timeout=left))
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """Waits for the child, then returns what it wrote to stdout and stderr.

        Args:
            timeout: As for :meth:`wait`.
        """
        self.wait(timeout)
        return self.stdout_path.read_text(errors="replace"), self.stderr_path.read_text(errors="replace")


class Zygote:
    """The fork server: started with :meth:`start`, one child at a time, ended with :meth:`close`.

    Args:
        workdir: Where the children's stdout/stderr files and program files go.
        env: The server's environment (import-time settings of the preloaded packages are read from it).
    """

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        with open(workdir / "zygote.err", "w") as errors:  # the server keeps its own copy of the descriptor
            self.server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, json.dumps(PRELOAD), json.dumps(FIRST_PARTY)], env=env,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1,
            )
        self.busy, self.count, self._pending = False, 0, b""
        if self.reply(timeout=300) is None:
            self.close()
            raise RuntimeError(f"the zygote did not start: {(workdir / 'zygote.err').read_text()[-2000:]}")

    def reply(self, timeout: float | None) -> dict | None:
        """The server's next reply line, or ``None`` if none came within ``timeout`` seconds.

        Args:
            timeout: Seconds to wait (0: do not wait; ``None``: no limit).
        """
        # Read the descriptor ourselves: a buffered reader could hold the next reply where select cannot see it.
        while b"\n" not in self._pending:
            ready, _, _ = select.select([self.server.stdout], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(self.server.stdout.fileno(), 65536)
            if not chunk:
                raise RuntimeError(f"the zygote died: {(self.workdir / 'zygote.err').read_text()[-2000:]}")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def start(self, script: Path, argv: list[str], env: dict[str, str], cwd: Path) -> ForkedProcess:
        """Forks a child that runs ``script`` as ``__main__`` with ``argv``, ``env`` and ``cwd``.

        Args:
            script: The program file.
            argv: Its arguments (``sys.argv[1:]``).
            env: Its whole environment.
            cwd: Its working directory.
        """
        if self.busy:
            raise RuntimeError("the zygote runs one child at a time; wait for the previous one first")
        self.count += 1
        out, err = self.workdir / f"child{self.count}.out", self.workdir / f"child{self.count}.err"
        request = {"script": str(script), "argv": list(argv), "env": dict(env), "cwd": str(cwd),
                   "stdout": str(out), "stderr": str(err)}
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        self.busy = True
        return ForkedProcess(self, self.reply(timeout=60)["pid"], out, err)

    def run(self, code: str, argv: list[str], env: dict[str, str], cwd: Path,
            timeout: float | None) -> subprocess.CompletedProcess:
        """Runs ``code`` in a child to its end, like :func:`subprocess.run` with ``capture_output=True``.

        Args:
            code: The program text.
            argv: Its arguments.
            env: Its whole environment.
            cwd: Its working directory.
            timeout: Seconds before it is killed (:class:`subprocess.TimeoutExpired`).
        """
        script = self.workdir / f"program{self.count + 1}.py"
        script.write_text(code)
        child = self.start(script, argv, env, cwd)
        stdout, stderr = child.communicate(timeout)
        return subprocess.CompletedProcess([str(script), *argv], child.returncode, stdout, stderr)

    def close(self) -> None:
        """Ends the server (its stdin closes; it exits after its current child)."""
        if self.server.poll() is None:
            self.server.stdin.close()
            try:
                self.server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.server.kill()
