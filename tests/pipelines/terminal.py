"""Run a command with its stderr on a pseudo-terminal, as a person at a terminal sees it (stdout stays a pipe, so a
`--json` result can still be read)."""

from __future__ import annotations

import fcntl
import os
import pty
import struct
import subprocess
import termios
import threading


def run_on_terminal(args: list[str], env: dict[str, str], *, columns: int = 120,
                    timeout: float = 900) -> tuple[int, str, str]:
    """(exit code, stdout, everything written to the terminal: carriage returns and redraws included)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
    seen: list[bytes] = []

    def read() -> None:
        while True:
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: the last writer closed the terminal
                return
            if not data:
                return
            seen.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=slave, env=env, text=True)
        os.close(slave)
        out, _ = proc.communicate(timeout=timeout)
        reader.join(timeout=10)
    finally:
        os.close(master)
    return proc.returncode, out, b"".join(seen).decode("utf-8", errors="replace")
