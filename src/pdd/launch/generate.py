"""`pdd generate`: run one engine locally on a prompt (like llama.cpp's CLI)."""

from __future__ import annotations

import argparse
import json
import sys

from pdd.engine.core.dtypes import AUTO, SERVING_DTYPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="default", help="HF checkpoint folder, .gguf file, or 'default' (SmolLM2-135M)")
    parser.add_argument("--prompt", required=True, help="prompt text")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    parser.add_argument("--system", default=None, help="system message (with --chat)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=0.0,
                        help="drop tokens below min_p x the top token's probability")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="> 1 discourages prompt/output tokens")
    parser.add_argument("--presence-penalty", type=float, default=0.0)
    parser.add_argument("--frequency-penalty", type=float, default=0.0)
    parser.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many output tokens")
    parser.add_argument("--ignore-eos", action="store_true", help="run to --max-tokens whatever the model says")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--json", action="store_true", help="print one JSON object with prompt and output token ids")
    parser.add_argument("--dtype", default=AUTO, choices=[AUTO, *SERVING_DTYPES],
                        help="weights dtype; auto (default, as `pdd up`): bfloat16 where the CPU has avx512_bf16 "
                             "or amx_bf16, else float32")
    parser.add_argument("--kv-dtype", default=AUTO, choices=[AUTO, *SERVING_DTYPES],
                        help="KV dtype; auto: the weights' dtype")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run(args: argparse.Namespace) -> int:
    from pdd.engine import EngineInputError, SamplingParams
    from pdd.engine.torch_backend.engine import TorchEngine
    from pdd.shared.tokenizer import render_chat

    try:
        engine = TorchEngine.from_model(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype, num_threads=args.threads,
                                   kv_memory_bytes=64 * 1024 * 1024)
        print(f"[pdd generate] {engine.dtype_choice.reason}; linear kernel {engine.model.linear_kernel}",
              file=sys.stderr)
        tok = engine.tokenizer
        prompt_ids = render_chat(tok, args.prompt, args.system) if args.chat else list(tok(args.prompt).input_ids)
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                stop=list(args.stop), min_p=args.min_p, repetition_penalty=args.repetition_penalty,
                                presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                min_tokens=args.min_tokens, ignore_eos=args.ignore_eos)
        engine.add_request("cli", prompt_ids, params, max_new_tokens=args.max_tokens)
    except (EngineInputError, FileNotFoundError, ValueError) as exc:  # ValueError: a dtype pair it cannot run
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out: list[int] = []
    reason = None
    printed = ""
    while engine.has_work():
        for o in engine.step():
            out.extend(o.token_ids)
            reason = o.finish_reason or reason
            if not args.json:
                text = tok.decode(out, skip_special_tokens=True)
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
    if args.json:
        print(json.dumps({"prompt": args.prompt, "prompt_token_ids": prompt_ids, "output_token_ids": out,
                          "text": tok.decode(out, skip_special_tokens=True), "finish_reason": reason}))
    else:
        sys.stdout.write("\n")
    return 0
