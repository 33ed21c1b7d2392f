"""The embedded model exported as a Hugging Face Llama directory (cache_impl/engine/hf_export.py).

That vLLM serving the export answers token for token what `kvgate serve` answers is proven against a live
vLLM (tests/engines/test_live_vllm.py); here, what the directory holds."""

import json

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from cache_impl.engine.hf_export import CHAT_TEMPLATE, EXPORTED_FILES, export_hf, generatable_ids, llama_tensors
from cache_impl.engine.model import PRESETS, build_model
from cache_impl.engine.tokenizer import EOS, SPECIALS, ByteTokenizer, ChatMessage


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return export_hf(tmp_path_factory.mktemp("hf") / "kvgate-tiny", "tiny", 3)


def test_the_tokenizer_gives_the_byte_tokenizers_ids_and_decodes_back(exported):
    tokenizer = Tokenizer.from_file(str(exported / "tokenizer.json"))
    text = "héllo wörld\n\ttabs €😀 \x00\x7f end"
    encoded = tokenizer.encode(text)
    assert encoded.ids == ByteTokenizer().encode(text)          # <|bos|> then the UTF-8 bytes
    assert tokenizer.decode(encoded.ids) == text
    assert {text: tokenizer.token_to_id(text) for text in SPECIALS} == SPECIALS


def test_the_chat_template_renders_the_engines_prompt(exported):
    import jinja2

    config = json.loads((exported / "tokenizer_config.json").read_text())
    assert config["chat_template"] == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    rendered = jinja2.Template(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=True)
    tokenizer = Tokenizer.from_file(str(exported / "tokenizer.json"))
    expected = ByteTokenizer().apply_chat_template([ChatMessage(m["role"], m["content"]) for m in messages])
    assert tokenizer.encode(rendered, add_special_tokens=False).ids == expected


def test_the_weights_are_the_models_under_llamas_names_with_the_output_scale_folded(exported):
    model = build_model("tiny", 3, torch.device("cpu"))
    tensors = load_file(str(exported / "model.safetensors"))
    assert set(tensors) == set(llama_tensors(model))
    args = PRESETS["tiny"]
    kv = args.n_kv_heads * args.head_dim
    fused = model.layers[1].wqkv.weight
    assert torch.equal(tensors["model.layers.1.self_attn.q_proj.weight"], fused[:args.dim])
    assert torch.equal(tensors["model.layers.1.self_attn.v_proj.weight"], fused[args.dim + kv:])
    assert torch.equal(tensors["model.layers.0.mlp.up_proj.weight"], model.layers[0].w13.weight[args.ffn_dim:])
    assert torch.equal(tensors["lm_head.weight"], model.output.weight * args.logit_scale)
    config = json.loads((exported / "config.json").read_text())
    assert (config["architectures"], config["num_key_value_heads"], config["head_dim"], config["eos_token_id"]) == \
        (["LlamaForCausalLM"], args.n_kv_heads, args.head_dim, EOS)


def test_the_generatable_ids_are_what_the_engine_samples_from():
    ids = generatable_ids()
    assert EOS in ids and 10 in ids and 0 not in ids and len(ids) == 97


def test_an_existing_export_is_refused_unless_forced(exported):
    with pytest.raises(FileExistsError, match="expected a directory without a checkpoint, found config.json"):
        export_hf(exported, "tiny", 3)
    assert export_hf(exported, "tiny", 4, overwrite=True) == exported


def test_kvgate_export_weights_format_hf_writes_the_directory_and_refuses_to_overwrite_it(tmp_path, capsys):
    from gates.cli import main

    target = tmp_path / "hf"
    assert main(["export-weights", str(target), "--format", "hf", "--preset", "tiny"]) == 0
    assert json.loads((target / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    capsys.readouterr()
    assert main(["export-weights", str(target), "--format", "hf", "--preset", "tiny"]) == 2
    assert f"dir: {target}: expected a directory without a checkpoint, found config.json" in capsys.readouterr().err


def test_a_directory_holds_one_format_refused_without_force_and_replaced_whole_with_it(tmp_path, capsys):
    from gates.cli import main

    target = tmp_path / "model"
    assert main(["export-weights", str(target), "--preset", "tiny"]) == 0          # kvgate's shards and index
    kvgate_files = sorted(p.name for p in target.iterdir())
    capsys.readouterr()
    assert main(["export-weights", str(target), "--format", "hf", "--preset", "tiny"]) == 2
    assert "expected a directory without a checkpoint, found model.safetensors.index.json" in capsys.readouterr().err
    assert sorted(p.name for p in target.iterdir()) == kvgate_files                 # refused: nothing written
    assert main(["export-weights", str(target), "--format", "hf", "--preset", "tiny", "--force"]) == 0
    assert sorted(p.name for p in target.iterdir()) == sorted(EXPORTED_FILES)       # no index for vLLM to follow
    assert main(["export-weights", str(target), "--preset", "tiny", "--force"]) == 0
    assert sorted(p.name for p in target.iterdir()) == kvgate_files                 # and back: kvgate's alone


def test_an_export_the_filesystem_cannot_hold_or_a_seed_past_its_range_is_exit_2_naming_it(tmp_path, capsys):
    import resource
    import signal
    import subprocess
    import sys

    from gates.cli import main

    assert main(["export-weights", str(tmp_path / "s"), "--preset", "tiny", "--seed", str(2**64)]) == 2
    assert f"--seed: expected an integer in 0..{2**63 - 1}, found {2**64}" in capsys.readouterr().err

    def small_files():      # a filesystem that takes 64 KiB a file: the weights' write fails as on a full disk
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    done = subprocess.run([sys.executable, "-m", "gates.cli", "export-weights", str(tmp_path / "full"), "--format",
                           "hf", "--preset", "tiny"], capture_output=True, text=True, timeout=300,
                          preexec_fn=small_files)
    assert done.returncode == 2, done.stderr
    assert f"dir: expected a directory kvgate can write, found {tmp_path / 'full'} refused" in done.stderr
    assert "Traceback" not in done.stderr
    assert list((tmp_path / "full").iterdir()) == []              # all or nothing: no half export left behind
    assert main(["export-weights", str(tmp_path / "full"), "--format", "hf", "--preset", "tiny"]) == 0   # no --force
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "full").iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes   # readable as the rest
