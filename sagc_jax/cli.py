"""The ``sagc-jax`` command line: sft, train, plan, eval, compare, report, export, tokenizer,
simulate, replay, config, fetch-model.

Every subcommand but ``report RUN``, ``export RUN OUT``, ``tokenizer`` and ``fetch-model`` takes
``--config FILE`` and any number of ``--set section.key=value``.
Bad input (config, paths, logs) ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from sagc_jax.commands import (
    compare,
    config,
    export,
    fetch_model,
    plan,
    report,
    sft,
    simulate,
    tokenizer,
    train,
)
from sagc_jax.commands import eval as eval_  # not to shadow the builtin
from sagc_jax.commands.common import bad_input_errors

EXIT_BAD_INPUT = 2
# 3 (sagc_jax.commands.train.EXIT_DIVERGED): training stopped: too many non-finite updates in a row
# 4 (sagc_jax.parallel.supervisor.EXIT_PEER_LOST): another process of the run died or failed

# in the order --help lists them; simulate's module also adds replay
COMMANDS = (
    sft,
    train,
    plan,
    eval_,
    compare,
    report,
    export,
    tokenizer,
    config,
    simulate,
    fetch_model,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sagc-jax",
        description="JAX-native GRPO/DAPO trainer with Straggler-Aware Group Control.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. SIGINT/SIGTERM end it with one line on stderr and exit code 128 +
    the signal number (130, 143), whatever it was doing (see ``sagc_jax.train.safety.faults``)."""
    from sagc_jax.train.safety.faults import Interrupted, received, stop_signals

    args = build_parser().parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else list(argv)  # what a supervised child reruns

    def stopped(stop: Interrupted) -> int:
        print(stop.message(args.command), file=sys.stderr)
        if argv is None:  # this process is the command (not a caller's test)
            # Interpreter teardown can crash (SIGSEGV) after an import or a compilation that
            # the signal cut short; every file is written and closed by now, so skip it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(128 + stop.signum)
        return 128 + stop.signum

    with stop_signals():
        try:
            code = args.func(args)
        except Interrupted as stop:
            return stopped(stop)
        except Exception as err:
            if received() is not None:  # the stop, wrapped into another error (a JAX callback)
                return stopped(Interrupted(received()))
            if not isinstance(err, bad_input_errors()):
                raise
            # Multi-line messages (a header, then one line per problem): header, first
            # problem, count.
            lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [""]
            head = " ".join(lines[:2])
            more = f" (+{len(lines) - 2} more)" if len(lines) > 2 else ""
            print(f"error: {head}{more}", file=sys.stderr)
            return EXIT_BAD_INPUT
        if code == 0 and received() is not None:  # swallowed, and the command ran to its end
            return stopped(Interrupted(received(), "", "it had finished: its results are written"))
        return code


if __name__ == "__main__":
    sys.exit(main())
