"""The ``xtrain`` command. Each subcommand lives in the module that owns its logic; this file only wires
them up (lazily, so ``xtrain micro`` never imports the tensor stack's heavier pieces).

Every owning module exposes ``add_parser(subparsers)`` which registers its subcommand and sets
``func=run`` (a function taking the parsed args and returning an exit code). A write that fails for a reason of
the disk, in any subcommand, ends here as one line and exit code 74 (``xtrain.fileio.WriteFailed``).

A command line that cannot be parsed (an unknown flag, a missing argument or command, a value that its
``xtrain.argtypes`` type refuses) is one line on stderr and exit code 2 (``Parser``), before any command runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module that defines add_parser(subparsers)
SUBCOMMANDS = {
    "check": "xtrain.check",
    "micro": "xtrain.micro.cli",
    "data": "xtrain.data.cli",
    "train": "xtrain.train.cli",
    "sample": "xtrain.train.sample_cli",
    "plot": "xtrain.train.plot",
    "export": "xtrain.export",
    "serve": "xtrain.serve.server",
    "bench": "xtrain.bench.cli",
}


class Parser(argparse.ArgumentParser):
    """argparse with xtrain's rule for refused input: one line on stderr, exit code 2 (argparse's own error
    prints the whole usage first). Every subcommand's parser is one of these (argparse makes subparsers of the
    parent's class), and a parser with subcommands requires one."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")

    def add_subparsers(self, **kwargs):
        kwargs.setdefault("required", True)
        return super().add_subparsers(**kwargs)


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(
        prog="xtrain",
        description="xtrain: a readable, verified LLM training stack (our own autograd, Triton kernels).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        if only is not None and name != only:
            sub.add_parser(name, help=f"(see: xtrain {name} --help)")
            continue
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name is not None and e.name.startswith("xtrain"):
                continue  # subcommand not built in this checkout
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # import only the chosen subcommand's module, so start-up stays fast
    only = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    parser = build_parser(only)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help (0), or a refused command line (2, one line already printed)
        return int(e.code or 0)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except OSError as e:
        # the one place where a write the disk refused (full, over ``ulimit -f``, read-only) becomes one line
        # and its exit code; the writer has already put back what was there (xtrain.fileio)
        from xtrain.fileio import EXIT_WRITE_FAILED, write_failure

        failed = write_failure(e)
        if failed is None:
            raise
        print(f"xtrain {args.command}: {failed}", file=sys.stderr)
        return EXIT_WRITE_FAILED
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
