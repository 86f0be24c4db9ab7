"""`seektrain chat`: talk to the newest checkpoint of a run (or a Hugging Face folder) through its chat
template. Each line typed is a user turn; the reply streams as it is generated, thinking apart from
the answer. ``--prompt`` answers one turn and exits (for scripts and pipes); lines on a non-terminal
stdin are turns as well. ``/reset`` starts over, ``/exit`` (or end of input) ends."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from seektrain.cli.arg_types import SEED, float_in, int_in, nonempty
from seektrain.data.chat_template import BUILTIN_TEMPLATES
from seektrain.data.hf_tokenizer import TEMPERATURE, TOP_P
from seektrain.errors import UserError
from seektrain.exit_codes import EXIT_OK

DIM, PLAIN = "\x1b[2m", "\x1b[0m"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="chat with a trained run or a Hugging Face folder")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="the run.dir of a training run (its newest checkpoint)")
    source.add_argument("--hf", help="a Hugging Face folder with tokenizer.json and a chat template")
    p.add_argument(
        "--chat-template",
        choices=BUILTIN_TEMPLATES,
        help="a built-in template instead of the tokenizer's own (for a tokenizer without one)",
    )
    p.add_argument("--prompt", type=nonempty, help="answer this one user turn and exit")
    p.add_argument("--system", help="a system prompt for the conversation")
    p.add_argument(
        "--temperature",
        type=float_in(0),
        default=TEMPERATURE,
        help=f"sampling temperature (>= 0; 0 = greedy; default {TEMPERATURE})",
    )
    p.add_argument(
        "--top-p",
        type=float_in(0, 1),
        default=TOP_P,
        help=f"sample from the likeliest tokens holding this much probability (default {TOP_P})",
    )
    p.add_argument("--max-new-tokens", type=int_in(1), default=256, help="longest reply in tokens (>= 1)")
    p.add_argument("--seed", type=SEED, default=0)
    p.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from seektrain.train.chat import Conversation, Sampling, load_hf_chat, load_run_chat

    if args.top_p == 0:
        raise UserError("--top-p 0 keeps no token; use a value in (0, 1]")
    chat = (
        load_run_chat(Path(args.run), args.chat_template)
        if args.run
        else load_hf_chat(Path(args.hf), args.chat_template)
    )
    conversation = Conversation(
        chat, Sampling(args.temperature, args.top_p, args.max_new_tokens, args.seed), system=args.system
    )
    terminal = sys.stdin.isatty() and sys.stdout.isatty()
    print(
        f"# {chat.source}" + ("" if args.prompt else "; /reset starts over, /exit or Ctrl-D ends"),
        file=sys.stderr,
    )
    if args.prompt:
        _answer(conversation, args.prompt, terminal)
        return EXIT_OK
    while (line := _read_turn(terminal)) is not None:
        if line == "/exit":
            break
        if line == "/reset":
            conversation.reset()
            print("# new conversation", file=sys.stderr)
        elif line:
            try:
                _answer(conversation, line, terminal)
            except ValueError as err:  # a conversation grown past the context: say so, keep chatting
                print(f"seektrain chat: {err}", file=sys.stderr)
    return EXIT_OK


def _read_turn(terminal: bool) -> str | None:
    """The next user line, None at the end of input."""
    if terminal:
        try:
            return input("you> ").strip()
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.strip() if line else None


def _answer(conversation, text: str, terminal: bool) -> None:
    """Print the reply as it streams: thinking inside [thinking] ... [/thinking] (dimmed on a terminal),
    then the answer; a statistics line goes to stderr."""
    kind = "answer"
    for piece_kind, piece in conversation.reply(text):
        if piece_kind != kind:
            _switch(kind, piece_kind, terminal)
            kind = piece_kind
        sys.stdout.write(piece)
        sys.stdout.flush()
    if kind == "think":
        _switch(kind, "answer", terminal)
    sys.stdout.write("\n")
    sys.stdout.flush()
    stats = conversation.last
    rate = stats.new_tokens / stats.seconds if stats.seconds else 0.0
    ended = "end of turn" if stats.stopped else "--max-new-tokens reached"
    print(
        f"# {stats.prompt_tokens} prompt tokens, {stats.new_tokens} generated ({rate:.1f}/s), {ended}",
        file=sys.stderr,
    )


def _switch(old: str, new: str, terminal: bool) -> None:
    if new == "think":
        sys.stdout.write((DIM if terminal else "") + "[thinking]\n")
    else:
        sys.stdout.write("\n[/thinking]" + (PLAIN if terminal else "") + "\n")
