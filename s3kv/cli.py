"""The ``s3kv`` command line."""

from __future__ import annotations

import argparse
import sys

from s3kv import __version__


def _demo(args: argparse.Namespace) -> int:
    from s3kv.demo import DemoOptions, run_demo

    return run_demo(
        DemoOptions(
            model=args.model,
            workdir=args.workdir,
            bucket=args.bucket,
            endpoint_url=args.endpoint_url,
            region=args.region,
            prefix=args.prefix,
            prompts=args.prompts,
            shared_tokens=args.shared_tokens,
        )
    )


def build_parser() -> argparse.ArgumentParser:
    from s3kv.demo import default_workdir

    parser = argparse.ArgumentParser(
        prog="s3kv", description="A tiered KV cache for vLLM, shared through S3."
    )
    parser.add_argument("--version", action="version", version=f"s3kv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="two replicas share one prefix cache through S3",
        description="Run replica A, then a fresh replica B, on prompts that share a prefix; "
        "B loads A's KV from S3. Without --bucket, a loopback S3 server is started.",
    )
    demo.add_argument("--model", help="model path or name (default: build a small random Llama)")
    demo.add_argument("--workdir", default=default_workdir(), help="where the model, logs and results go")
    demo.add_argument("--bucket", help="use this S3 bucket instead of a loopback server")
    demo.add_argument("--endpoint-url", help="S3-compatible endpoint for --bucket")
    demo.add_argument("--region", default="us-east-1")
    demo.add_argument("--prefix", default="s3kv-demo", help="key prefix in the bucket")
    demo.add_argument("--prompts", type=int, default=4, help="prompts per replica")
    demo.add_argument("--shared-tokens", type=int, default=1536, help="length of the shared prefix")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
