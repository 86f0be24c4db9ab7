"""Issue 20's "done when", through the real CLI on 2 CPU processes: a chat JSONL file is prepared with
a tokenizer folder that has a template, `data show` marks exactly the assistant turns, training starts
from a Hugging Face folder with packing on, the tokenizer and template travel with the run folder,
`chat` answers from the run (one turn, and turns piped on stdin), and the exported folder loads in
transformers with the same logits, the same rendered prompt and the same greedy answer."""

from __future__ import annotations

import json

import torch

from chat_fixtures import (
    ANSWERS,
    EOS,
    QUESTIONS,
    TEMPLATE,
    build_chat_tokenizer,
    conversations,
    write_chat_jsonl,
)
from run_cli import losses, seektrain, train
from seektrain.data.chat_template import load_chat_template
from seektrain.data.tokenizer import load_tokenizer
from seektrain.train.generate import load_run_weights


def assistant_mask(ids: list[int], tok) -> list[int]:
    """The oracle, from DeepSeek-V3's template alone: a token is trained from the one after
    ``<｜Assistant｜>`` up to and including the EOS that ends that turn."""
    assistant, eos = tok.encode_chat("<｜Assistant｜>")[0][0], tok.eos_id
    mask, inside = [], False
    for i in ids:
        mask.append(int(inside))
        inside = (inside and i != eos) or i == assistant
    return mask


def test_chat_jsonl_to_a_chat_with_the_fine_tuned_run(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = build_chat_tokenizer(tmp_path / "tok")
    data, hf, run, export = (tmp_path / name for name in ("data", "hf", "run", "export"))
    seektrain(
        "data",
        "prepare",
        "--input",
        str(write_chat_jsonl(tmp_path / "chat.jsonl")),
        "--tokenizer",
        str(tok_dir),
        "--output",
        str(data),
        "--val-fraction",
        "0",
    )

    hf_tok, tok = AutoTokenizer.from_pretrained(tok_dir), load_tokenizer(str(tok_dir))
    for index in (0, 1, 4):  # system + two turns, one plain turn, system + ... as conversations() builds them
        shown = json.loads(seektrain("data", "show", str(data), "--index", str(index), "--json").stdout)
        assert shown["tokens"] == hf_tok.apply_chat_template(conversations()[index]["messages"])["input_ids"]
        assert shown["loss_mask"] == assistant_mask(shown["tokens"], tok) and sum(shown["loss_mask"]) > 0

    seektrain("convert", "--preset", "tiny-v3", "--to-hf", str(hf), "--tokenizer", str(tok_dir))
    train(
        run,
        f"model.hf_path={hf}",
        f"data.path={data}",
        "data.packing=true",
        "train.steps=20",
        "optim.lr=3e-3",
        "train.eval_interval=0",
        nproc=2,
        timeout=600,
    )
    assert losses(run)[-1] < losses(run)[0] - 4  # the answers are learnt (starts near ln 320 = 5.8 + 1.7)
    assert (run / "tokenizer" / "tokenizer.json").read_bytes() == (tok_dir / "tokenizer.json").read_bytes()
    assert json.loads((run / "tokenizer" / "tokenizer_config.json").read_text())["chat_template"] == TEMPLATE

    tok_dir.rename(tmp_path / "tok-moved")  # from here on only the run folder's copy holds the tokenizer
    one = seektrain(
        "chat", "--run", str(run), "--prompt", QUESTIONS[2], "--temperature", "0", "--max-new-tokens", "12"
    )
    answer = one.stdout.strip()
    assert answer in ANSWERS and "end of turn" in one.stderr and "step-00000020" in one.stderr
    piped = seektrain(
        "chat",
        "--run",
        str(run),
        "--temperature",
        "0",
        "--max-new-tokens",
        "12",
        input=f"{QUESTIONS[2]}\n{QUESTIONS[5]}\n",
    )
    replies = piped.stdout.splitlines()
    assert len(replies) == 2 and replies[0] == answer and replies[1] in ANSWERS

    seektrain("convert", "--from-checkpoint", str(run), "--to-hf", str(export))
    assert json.loads((export / "generation_config.json").read_text())["eos_token_id"] == tok.eos_id
    exported_tok = AutoTokenizer.from_pretrained(export)
    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": QUESTIONS[2]}]
    ids = exported_tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    ours = load_chat_template(str(export), tok=tok).render(messages, add_generation_prompt=True)
    assert tok.encode_chat(ours)[0] == ids
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = model(x).logits
        torch.testing.assert_close(theirs, load_run_weights(run)[0](x).logits, rtol=1e-4, atol=1e-4)
    plain = exported_tok.apply_chat_template(messages[1:], add_generation_prompt=True)["input_ids"]
    out = model.generate(torch.tensor([plain]), max_new_tokens=12, do_sample=False)[0, len(plain) :].tolist()
    assert exported_tok.decode(out) == answer + EOS  # transformers stops at the same end of turn
