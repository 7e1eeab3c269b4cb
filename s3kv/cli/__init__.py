"""The ``s3kv`` command line: the demo, and looking after a shared bucket.

Every command takes the connector's bucket settings (flags, ``S3KV_*``
environment variables, or ``--config`` with the connector's JSON), prints
tables (or one JSON document with ``--json``) on stdout, progress on stderr,
and one line ``s3kv: error: ...`` for anything that stops it, with an exit
code a script can act on (see :mod:`s3kv.cli.settings`).
"""

from __future__ import annotations

import logging
import sys

import click

from s3kv import __version__
from s3kv.cli.settings import EXIT_BUSY, EXIT_CODES_HELP, EXIT_INTERNAL, EXIT_STORAGE, EXIT_USAGE
from s3kv.errors import ConfigError, S3KVError, StorageProblem


@click.group(
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110},
    epilog=EXIT_CODES_HELP,
)
@click.version_option(__version__, prog_name="s3kv")
@click.option("-v", "--verbose", count=True, help="Log more (-v: info, -vv: debug) on stderr.")
def cli(verbose: int) -> None:
    """A tiered KV cache for vLLM, shared through S3: the demo, and tools for the bucket."""
    logging.basicConfig(
        level=logging.WARNING - 10 * min(verbose, 2),
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )


@cli.command("demo")
@click.option("--model", help="Model path or name (default: build a small random Llama).")
@click.option("--workdir", default=None, help="Where the model, logs and results go.")
@click.option("--bucket", help="Use this S3 bucket instead of a loopback server.")
@click.option("--endpoint-url", help="S3-compatible endpoint for --bucket.")
@click.option("--region", default="us-east-1", show_default=True)
@click.option("--prefix", default="s3kv-demo", show_default=True, help="Key prefix in the bucket.")
@click.option("--prompts", type=click.IntRange(1), default=4, show_default=True, help="Prompts per replica.")
@click.option(
    "--shared-tokens",
    type=click.IntRange(1),
    default=1536,
    show_default=True,
    help="Length of the shared prefix.",
)
def demo_cmd(model, workdir, bucket, endpoint_url, region, prefix, prompts, shared_tokens) -> int:
    """Two replicas share one prefix cache through S3: replica A runs, then a fresh
    replica B loads A's KV from S3. Without --bucket, a loopback S3 server is started."""
    from s3kv.demo import DemoOptions, default_workdir, run_demo

    return run_demo(
        DemoOptions(
            model=model,
            workdir=workdir or default_workdir(),
            bucket=bucket,
            endpoint_url=endpoint_url,
            region=region,
            prefix=prefix,
            prompts=prompts,
            shared_tokens=shared_tokens,
        )
    )


def _register() -> None:
    from s3kv.cli.gc import gc_cmd
    from s3kv.cli.inspection import inspect_cmd
    from s3kv.cli.report import ls_cmd, stats_cmd
    from s3kv.cli.verify import verify_cmd

    for cmd in (ls_cmd, stats_cmd, inspect_cmd, verify_cmd, gc_cmd):
        cli.add_command(cmd)


_register()


def _fail(message: str, code: int) -> int:
    text = " ".join(str(message).split())  # one line, whatever the message held
    click.echo(f"s3kv: error: {text}", err=True)
    return code


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code instead of raising SystemExit."""
    from s3kv.errors import LockBusy, LockLost

    args = sys.argv[1:] if argv is None else argv
    if not args:
        click.echo(cli.get_help(click.Context(cli, info_name="s3kv")))
        return EXIT_USAGE
    try:
        rv = cli.main(args=args, prog_name="s3kv", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.Abort:
        return _fail("aborted", 130)
    except click.UsageError as e:
        hint = (
            f" (see: s3kv {e.ctx.info_name} --help)" if e.ctx is not None and e.ctx.parent is not None else ""
        )
        return _fail(e.format_message() + hint, EXIT_USAGE)
    except click.ClickException as e:
        return _fail(e.format_message(), EXIT_USAGE)
    except (ConfigError, ValueError) as e:
        return _fail(str(e), EXIT_USAGE)
    except (LockBusy, LockLost) as e:
        return _fail(str(e), EXIT_BUSY)
    except (StorageProblem, S3KVError) as e:
        return _fail(str(e), EXIT_STORAGE)
    except KeyboardInterrupt:
        return _fail("interrupted", 130)
    except BrokenPipeError:  # `s3kv gc --dry-run | head`: the reader has what it wanted
        sys.stderr.close()
        return 0
    except Exception as e:  # a bug: still one line, and not a code a script reads as a finding
        return _fail(f"internal error: {type(e).__name__}: {e} (run with -v, or report it)", EXIT_INTERNAL)
    return int(rv or 0)


if __name__ == "__main__":
    sys.exit(main())
