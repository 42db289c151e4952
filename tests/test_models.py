"""Model loading (train/models/loading.py), the tiny test models and the generated data sets."""

from __future__ import annotations

import importlib.util
import json
import math
import re
from pathlib import Path

import pytest

from crystal_grpo.train.fixtures import shapes, tiny_models, wordproblems

REPO_ROOT = Path(__file__).resolve().parents[1]
REQUIRED = ("id", "question", "answer", "reference_steps", "source")


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_test_{name}", REPO_ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


# --------------------------------------------------------------------------- tiny causal LM
TEXTS = [
    "Tom buys 3 packs of 4 pencils, so he has 3 * 4 = 12 pencils.",
    '{"reasoning_steps": ["Mia has 2 * 6 = 12 apples.", "Each friend gets 12 / 3 = 4."], "answer": "4"}',
    '```json\n{"answer": "B"}\n```  Options: (A) 12 (B) 15',
    "Unicode: café, naïve, 😀 and\ttabs\n\n  spaces",
]


def test_tiny_lm_token_ids_survive_save_and_reload(tiny_lm_path):
    from transformers import AutoTokenizer

    raw = tiny_models.train_tokenizer()  # the tokenizer as trained, before saving
    tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids == raw.encode(text).ids, text
        assert tok.decode(ids) == text
    assert 700 <= len(tok) <= 1100
    assert tok.eos_token == "<|im_end|>" and tok.pad_token is not None and tok.pad_token != tok.eos_token
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert chat.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    # Special tokens are single ids; numbers and JSON keys tokenise into few pieces.
    assert len(tok("<|im_start|><|im_end|>")["input_ids"]) == 2
    assert len(tok('"reasoning_steps"')["input_ids"]) <= 4


def test_tiny_lm_loads_via_load_policy_and_generates(tiny_lm_path):
    import torch

    from crystal_grpo.train.models.loading import ModelSection, load_policy

    model, tok = load_policy(ModelSection(str(tiny_lm_path)))
    assert type(model).__name__ == "Qwen2ForCausalLM" and model.dtype == torch.float32
    assert tok.padding_side == "left" and tok.pad_token_id is not None
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
        for q in ("What is 2 + 3?", "Sam has 4 boxes of 6 eggs. How many eggs does he have?")
    ]
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert (batch["attention_mask"][0, 0] == 0) and (batch["attention_mask"][:, -1] == 1).all()  # left padded
    out = model.generate(**batch, max_new_tokens=5, do_sample=False)
    n = batch["input_ids"].shape[1]
    assert out.shape[0] == 2 and n < out.shape[1] <= n + 5
    assert len(tok.batch_decode(out[:, n:], skip_special_tokens=True)) == 2


def test_builders_are_idempotent(tiny_lm_path):
    before = (tiny_lm_path / "model.safetensors").stat().st_mtime_ns
    assert tiny_models.build_tiny_lm(tiny_lm_path) == Path(tiny_lm_path)
    assert (tiny_lm_path / "model.safetensors").stat().st_mtime_ns == before


# --------------------------------------------------------------------------- tiny VLM
def test_tiny_vlm_has_a_real_processor_and_generates_from_an_image(tiny_vlm_path, tiny_lm_path):
    import torch
    from PIL import Image
    from transformers import AutoTokenizer, PreTrainedTokenizerBase
    from transformers.processing_utils import ProcessorMixin

    from crystal_grpo.train.models.loading import ModelSection, is_vision_language, load_policy

    model, proc = load_policy(ModelSection(str(tiny_vlm_path)))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration" and is_vision_language(model.config)
    assert isinstance(proc, ProcessorMixin) and not isinstance(proc, PreTrainedTokenizerBase)
    assert proc.image_processor is not None and proc.tokenizer.padding_side == "left"
    # Same ids as the LM tokenizer for ordinary text; vision tokens are single special ids.
    lm_tok = AutoTokenizer.from_pretrained(tiny_lm_path)
    assert proc.tokenizer(TEXTS[0])["input_ids"] == lm_tok(TEXTS[0])["input_ids"]
    assert proc.tokenizer.convert_tokens_to_ids("<|image_pad|>") == model.config.image_token_id

    image = Image.open(REPO_ROOT / "data" / "shapes" / "images" / "shape-001.png").convert("RGB")
    messages = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": image},
                {"type": "text", "text": "How many red circles are there?"},
            ],
        }
    ]
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert "<|vision_start|><|image_pad|><|vision_end|>How many red circles" in text
    inputs = proc(text=[text], images=[image], return_tensors="pt", padding=True)
    grid = inputs["image_grid_thw"]
    n_image_tokens = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image_tokens == int(grid.prod()) // proc.image_processor.merge_size**2 > 0
    with torch.no_grad():
        logits = model(**inputs).logits
    assert logits.shape[:2] == inputs["input_ids"].shape and torch.isfinite(logits).all()
    out = model.generate(**inputs, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= inputs["input_ids"].shape[1] + 4
    # The tokenized chat-template path TRL uses for conversational VLM prompts.
    tokenized = proc.apply_chat_template([messages], add_generation_prompt=True, tokenize=True, return_dict=True)
    assert "pixel_values" in tokenized and "image_grid_thw" in tokenized


def test_autoprocessor_alone_returns_a_bare_tokenizer(tiny_vlm_path):
    """Why load_policy builds the processor itself (if this starts failing, the fallback may go)."""
    from transformers import AutoProcessor
    from transformers.processing_utils import ProcessorMixin

    assert not isinstance(AutoProcessor.from_pretrained(tiny_vlm_path), ProcessorMixin)


def _image_inputs(processor, image):
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "How many?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=[image], return_tensors="pt")


def _image_token_count(processor, image) -> int:
    ids = _image_inputs(processor, image)["input_ids"]
    return int((ids == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")).sum())


def test_max_pixels_sets_the_image_tokens_everywhere_a_processor_loads(tiny_vlm_path, tmp_path):
    """model.vision's bounds reach the policy (training, validation, SFT), a checkpoint loaded
    for evaluation (from the run's recorded config) and export: one 448 x 336 image is 192
    tokens under the default bound, 48 under 37,632 pixels; a 28 x 28 one is raised to 16."""
    import torch
    from PIL import Image

    from crystal_grpo.train.models.loading import ModelSection, load_checkpoint, load_policy
    from crystal_grpo.train.models.vision import VisionSection, image_tokens
    from crystal_grpo.train.tools.evaluate import EvalSetup
    from crystal_grpo.train.tools.export import export

    photo, dot = Image.new("RGB", (448, 336), (90, 20, 200)), Image.new("RGB", (28, 28), (0, 200, 0))
    model, default = load_policy(ModelSection(str(tiny_vlm_path)))
    assert _image_token_count(default, photo) == image_tokens(default, 336, 448) == 16 * 12
    small = VisionSection(max_pixels=28 * 28 * 48, min_pixels=28 * 28 * 16)
    _, bounded = load_policy(ModelSection(str(tiny_vlm_path), vision=small))
    assert _image_token_count(bounded, photo) == image_tokens(bounded, 336, 448) == 8 * 6  # halved on each side
    assert _image_token_count(bounded, dot) == 16 and _image_token_count(default, dot) == 4
    with torch.no_grad():  # the model takes the resized image's patches
        assert torch.isfinite(model(**_image_inputs(bounded, photo)).logits).all()
    recorded = EvalSetup.from_config_dict({"model": {"name_or_path": "x", "vision": {"max_pixels": 28 * 28 * 48}}})
    assert recorded.vision.max_pixels == 28 * 28 * 48
    _, evaluated = load_checkpoint(tiny_vlm_path, vision=recorded.vision)
    assert _image_token_count(evaluated, photo) == 48
    export(tiny_vlm_path, tmp_path / "out", say=lambda _: None)  # outside a run: model.vision's defaults
    saved = json.loads((tmp_path / "out" / "processor_config.json").read_text())["image_processor"]["size"]
    assert saved == {"shortest_edge": 3136, "longest_edge": 602112}  # the folder's own processor said 12,544


def test_other_families_keep_their_own_resizing_with_a_warning(caplog):
    """CLIP-style processors (LLaVA's) name edge lengths, not areas: the bounds do not apply."""
    from types import SimpleNamespace

    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from crystal_grpo.train.models.vision import VisionSection, image_tokens, resolution_line, set_image_resolution

    processor = SimpleNamespace(image_processor=CLIPImageProcessorPil())
    with caplog.at_level("WARNING"):
        set_image_resolution(processor, VisionSection())
    assert dict(processor.image_processor.size) == {"shortest_edge": 224}
    assert "CLIPImageProcessorPil keeps its own resizing" in caplog.text
    assert image_tokens(processor, 480, 640) is None and "own resizing" in resolution_line(processor)


def test_every_vlm_family_in_the_table_has_its_parts_in_transformers():
    """VLM_PARTS names real modules: each family's model, built from its default config on the
    meta device (no memory), splits into a non-empty vision tower, projector and language model."""
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    from crystal_grpo.train.models.vision import VLM_PARTS, parameter_counts

    for model_type in VLM_PARTS:
        cls = getattr(transformers, MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES[model_type])
        with torch.device("meta"):
            model = cls._from_config(AutoConfig.for_model(model_type))
        counts = parameter_counts(model)
        assert set(counts) == {"vision tower", "projector", "language model"}, model_type
        assert all(total > 0 for _, total in counts.values()), (model_type, counts)
        assert sum(total for _, total in counts.values()) == sum(p.numel() for p in model.parameters())


def test_parameter_counts_take_zero3s_full_sizes():
    """Under DeepSpeed ZeRO-3 a rank holds an empty slice of each parameter and DeepSpeed records
    the full size as ``ds_numel`` (a 2-process run of the tiny VLM printed 0 of 0 without it)."""
    import torch

    from crystal_grpo.train.models.vision import parameter_counts

    layer = torch.nn.Linear(4, 3)
    for p in layer.parameters():
        p.ds_numel, p.data = p.numel(), torch.empty(0)
    layer.bias.requires_grad_(False)
    assert parameter_counts(layer) == {"model": (12, 15)}


def test_freezing_and_lora_targets_split_the_tiny_vlm_into_its_parts(tiny_vlm_path, caplog):
    import torch
    from peft import get_peft_model

    from crystal_grpo.train.models.loading import LoraSection, ModelSection, load_policy, peft_config
    from crystal_grpo.train.models.vision import VisionError, VisionSection, freeze_parts, parameter_line

    frozen = ModelSection(str(tiny_vlm_path), vision=VisionSection(freeze_vision_tower=True, freeze_projector=True))
    model, _ = load_policy(frozen)
    trains = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trains and all(n.startswith("model.language_model.") for n in trains)
    assert parameter_line(model) == (
        "trainable parameters: 130,432 of 203,456 (64.1%): vision tower 0 of 48,224 "
        "(frozen), projector 0 of 24,800 (frozen), language model 130,432 of 130,432"
    )
    # LoRA's default targets: the language model's linear layers, every one of them, nothing else.
    model, _ = load_policy(ModelSection(str(tiny_vlm_path)))
    language = {
        n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.language_model.")
    }
    wrapped = get_peft_model(model, peft_config(ModelSection("x", lora=LoraSection(r=4)), model))
    adapted = {n.removeprefix("base_model.model.") for n, m in wrapped.named_modules() if hasattr(m, "lora_A")}
    assert adapted == language and len(language) == 2 * 7
    assert "vision tower 0 of 48,224 (frozen), projector 0 of 24,800 (frozen)" in parameter_line(wrapped)
    # The user's explicit targets win: all-linear adapts the vision tower and projector too.
    model, _ = load_policy(ModelSection(str(tiny_vlm_path)))
    everything = get_peft_model(
        model, peft_config(ModelSection("x", lora=LoraSection(target_modules="all-linear")), model)
    )
    assert any(
        n.startswith("base_model.model.model.visual.merger") and "lora_A" in n
        for n, _ in everything.named_parameters()
    )
    # A family whose parts are unknown: trained and counted whole; freezing it is refused.
    model.config.model_type = "some_vlm"
    assert parameter_line(model).endswith(
        "not split into parts: model_type 'some_vlm' (vision tower / projector / "
        "language model known for: gemma3, glm4v, idefics3, internvl, llava, "
        "llava_next, llava_onevision, mllama, paligemma, qwen2_5_vl, qwen2_vl, "
        "qwen3_vl, qwen3_vl_moe, smolvlm)"
    )
    with pytest.raises(VisionError, match="cannot tell the vision tower apart in model_type 'some_vlm'"):
        freeze_parts(model, VisionSection(freeze_vision_tower=True))
    with caplog.at_level("WARNING"):
        assert peft_config(ModelSection("x", lora=LoraSection()), model).target_modules == "all-linear"
    assert "LoRA adapts every linear layer, the vision tower's too" in caplog.text


# --------------------------------------------------------------------------- config mapping and errors
def test_peft_config_mapping():
    from peft import LoraConfig

    from crystal_grpo.train.models.loading import LoraSection, ModelSection, peft_config

    assert peft_config(ModelSection("x")) is None
    cfg = peft_config(
        ModelSection("x", lora=LoraSection(r=8, alpha=16, dropout=0.1, target_modules=["q_proj", "v_proj"]))
    )
    assert isinstance(cfg, LoraConfig)
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout) == (8, 16, 0.1)
    assert set(cfg.target_modules) == {"q_proj", "v_proj"} and cfg.task_type == "CAUSAL_LM"
    assert peft_config(ModelSection("x", lora=LoraSection())).target_modules == "all-linear"


def test_peft_config_accepts_the_yaml_sections():
    from crystal_grpo.train.config.run_config import LoraSection, ModelSection
    from crystal_grpo.train.models.loading import peft_config

    cfg = peft_config(ModelSection(name_or_path="x", lora=LoraSection(r=4, alpha=8)))
    assert (cfg.r, cfg.lora_alpha, cfg.lora_dropout, cfg.target_modules) == (4, 8, 0.05, "all-linear")


def test_lora_wraps_the_tiny_lm(tiny_lm_path):
    from peft import get_peft_model

    from crystal_grpo.train.models.loading import LoraSection, ModelSection, load_policy, peft_config

    cfg = ModelSection(str(tiny_lm_path), lora=LoraSection(r=4, alpha=8))
    model, _ = load_policy(cfg)
    assert not hasattr(model, "peft_config")  # not wrapped: TRL wraps it
    wrapped = get_peft_model(model, peft_config(cfg))
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in wrapped.parameters()) / 2


def test_internvl_needs_trust_remote_code(tmp_path):
    from crystal_grpo.train.models.loading import ModelLoadError, ModelSection, load_policy

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "internvl_chat",
                "architectures": ["InternVLChatModel"],
                "auto_map": {
                    "AutoConfig": "configuration_internvl_chat.InternVLChatConfig",
                    "AutoModel": "modeling_internvl_chat.InternVLChatModel",
                },
            }
        )
    )
    with pytest.raises(ModelLoadError, match=r"model\.trust_remote_code"):
        load_policy(ModelSection(str(tmp_path)))
    assert ModelSection("x").trust_remote_code is False


def test_missing_local_path_says_what_was_tried(tmp_path):
    from crystal_grpo.train.models.loading import ModelLoadError, ModelSection, load_policy

    missing = tmp_path / "no" / "such-model"
    with pytest.raises(ModelLoadError) as err:
        load_policy(ModelSection(str(missing)))
    assert str(missing) in str(err.value) and "name_or_path" in str(err.value)


def test_uncached_hub_id_says_how_to_use_a_local_folder(monkeypatch):
    from crystal_grpo.train.models.loading import ModelLoadError, ModelSection, load_policy

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError) as err:
        load_policy(ModelSection("crystal-tests/not-a-cached-model"))
    msg = str(err.value)
    assert "crystal-tests/not-a-cached-model" in msg and "local" in msg and "name_or_path" in msg


def test_empty_folder_and_missing_gguf_file(tmp_path):
    from crystal_grpo.train.models.loading import ModelLoadError, ModelSection, load_policy

    with pytest.raises(ModelLoadError, match=re.escape(str(tmp_path))):
        load_policy(ModelSection(str(tmp_path)))
    with pytest.raises(ModelLoadError, match="gguf_file"):
        load_policy(ModelSection(str(tmp_path), gguf_file="model.Q4_1.gguf"))
    with pytest.raises(ValueError, match="dtype"):
        load_policy(ModelSection(str(tmp_path), dtype="int8"))


def test_gguf_loads_as_a_plain_trainable_model_with_its_tokenizer(tmp_path, tiny_lm_path):
    """The demo model's path (a GGUF file, scripts/prepare_smollm2.py) on the tiny LM written as
    GGUF: load_gguf_plain with a dtype name gives the same weights without quantization_config,
    and load_policy reads the tokenizer from the file too."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from crystal_grpo.train.models.loading import ModelSection, load_gguf_plain, load_policy

    gguf_file = tiny_models.build_tiny_gguf(tiny_lm_path, tmp_path)
    model = load_gguf_plain(str(tmp_path), gguf_file.name, "float32")
    assert not hasattr(model.config, "quantization_config") and model.dtype == torch.float32
    ref, got = load_file(str(tiny_lm_path / "model.safetensors")), model.state_dict()
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    _, tok = load_policy(ModelSection(str(tmp_path), gguf_file=gguf_file.name))
    text = 'Tom has 3 apples. {"answer": "7"}'
    assert tok(text)["input_ids"] == AutoTokenizer.from_pretrained(tiny_lm_path)(text)["input_ids"]


def test_prepare_smollm2_is_idempotent(tmp_path):
    out = tmp_path / "SmolLM2"
    out.mkdir()
    (out / "config.json").write_text("{}")
    assert _script("prepare_smollm2").prepare(out) == out  # returns at once, downloads nothing


SMOLLM2 = REPO_ROOT / ".cache" / "models" / "SmolLM2-135M-Instruct"


@pytest.mark.skipif(not (SMOLLM2 / "config.json").exists(), reason="run scripts/prepare_smollm2.py first")
def test_converted_smollm2_is_trainable_and_answers():
    from transformers.trainer_utils import validate_quantization_for_training

    from crystal_grpo.train.models.loading import ModelSection, load_policy

    model, tok = load_policy(ModelSection(str(SMOLLM2)))
    validate_quantization_for_training(model)  # not "purely quantized"
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4? Answer with a number."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert "7" in tok.decode(out[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)


# --------------------------------------------------------------------------- data files
def test_make_data_is_deterministic_and_matches_the_committed_files(tmp_path):
    wordproblems.make(tmp_path / "a")
    wordproblems.make(tmp_path / "b")
    for name in ("train.jsonl", "val.jsonl"):
        committed = (REPO_ROOT / "data" / "wordproblems" / name).read_bytes()
        assert (tmp_path / "a" / name).read_bytes() == committed, f"{name}: re-run scripts/make_data.py"
        assert (tmp_path / "b" / name).read_bytes() == committed


def test_make_shapes_is_deterministic_and_matches_the_committed_files(tmp_path):
    shapes.generate(tmp_path / "a")
    shapes.generate(tmp_path / "b")
    committed = REPO_ROOT / "data" / "shapes"
    files = sorted(p.relative_to(committed) for p in committed.rglob("*") if p.is_file())
    assert Path("shapes.jsonl") in files and len(files) == 1 + len(_rows(committed / "shapes.jsonl"))
    for rel in files:
        assert (tmp_path / "a" / rel).read_bytes() == (committed / rel).read_bytes(), str(rel)
        assert (tmp_path / "b" / rel).read_bytes() == (committed / rel).read_bytes(), str(rel)


_STEP_CALC = re.compile(r"(\d+(?: [-+*/] \d+)+) = (\d+)")


def test_word_problem_rows_are_well_formed():
    from crystal_grpo.train.data.splits import row_problems

    base = REPO_ROOT / "data" / "wordproblems"
    train, val = _rows(base / "train.jsonl"), _rows(base / "val.jsonl")
    assert len(train) >= 300 and len(val) >= 48
    ids = [r["id"] for r in train + val]
    assert len(set(ids)) == len(ids) and all(re.fullmatch(r"wp-\d{4}", i) for i in ids)
    assert not {r["question"] for r in train} & {r["question"] for r in val}
    for r in train + val:
        assert all(r.get(k) for k in REQUIRED), r["id"]
        assert row_problems(r, base) == [], r["id"]
        assert 2 <= len(r["reference_steps"]) <= 8
        if "choices" in r:
            assert len(r["choices"]) == 4 and r["answer"] in "ABCD"
            assert r["choices"]["ABCD".index(r["answer"])] in r["reference_steps"][-1]
        else:
            assert re.fullmatch(r"\d+", r["answer"])
            assert r["answer"] in r["reference_steps"][-1]
        for step in r["reference_steps"]:  # every computation in a step is right
            for expr, result in _STEP_CALC.findall(step):
                assert eval(expr) == int(result), (r["id"], step)  # noqa: S307 - digits and operators only
    steps = {len(r["reference_steps"]) for r in train}
    assert steps == set(range(2, 9))  # the curriculum needs the spread
    assert {r["source"] for r in train} == {"shopping", "sharing", "ages", "rates", "multi_step"}
    assert 0.15 <= sum("choices" in r for r in train) / len(train) <= 0.25


def test_shape_rows_are_well_formed():
    from PIL import Image

    from crystal_grpo.train.data.splits import row_problems

    base = REPO_ROOT / "data" / "shapes"
    rows = _rows(base / "shapes.jsonl")
    assert 20 <= len(rows) <= 40
    for r in rows:
        assert all(r.get(k) for k in REQUIRED) and not Path(r["image"]).is_absolute()
        assert row_problems(r, base) == [], r["id"]
        with Image.open(base / r["image"]) as im:
            assert 64 <= im.size[0] <= 96 and im.format == "PNG"
        assert r["answer"] in ("yes", "no", "A", "B", "C") or r["answer"].isdigit()


# --------------------------------------------------------------------------- benchmark models and runs
def test_mid_lm_builder_at_small_size_warms_up_on_full_answers(tmp_path):
    """build_mid_lm's path (all reference steps, right padding, clipping) on a 2-layer model."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tiny_models.build_mid_lm(tmp_path / "mid", layers=2, hidden=128, steps=3)
    model, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert model.config.num_hidden_layers == 2 and model.config.intermediate_size == 128 * 38 // 7
    assert tok.padding_side == "left", "the warm-up's right padding must not leak into the saved tokenizer"
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # A warm-up with a given padding side restores the tokenizer's own afterwards.
    loss = tiny_models.warm_up_format(
        model, tok, steps=1, batch_size=2, lr=1e-4, target_steps=None, padding_side="right", max_grad_norm=1.0
    )
    assert math.isfinite(loss) and tok.padding_side == "left"


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_train_settings_are_valid_configs(cuda, tmp_path):
    """Every setting bench_train.py launches parses into a valid run config (the overrides
    name real keys), with the launcher, entry and switches the setting names; the plain-TRL
    baseline gets exactly the same overrides as the framework's runs."""
    import argparse

    from crystal_grpo.train.benchmarks import training as bench
    from crystal_grpo.train.config.run_config import load_config

    a = argparse.Namespace(
        dtype="bfloat16",
        encoder="packaged:all-MiniLM-L6-v2",
        warmup=1,
        steps=2,
        batch=16,
        completion_length=64,
        learning_rate=0.0,
        seed=7,
        config="tiny.yaml",
    )
    names = (
        "trl-full",
        "trl-lora",
        "plain-full",
        "plain-lora",
        "plain-full-answer",
        "plain-full-pcgrad",
        "zero3-full",
        "zero3-lora",
        "zero3-full-pcgrad",
        "zero3-lora-answer-pcgrad",
        "plain-lora-unmerged",
        "trl-full-static",
        "plain-full-static",
        "trl-lora-cb",
        "plain-lora-answer-pcgrad-cb",
        "trl-zero3-lora",
        "trl-zero3-full-cpr",
        "plain-full-answer-credit",
        "zero3-lora-credit-pcgrad",
    )
    configs = {}
    for setting in names:
        cmd = bench.command(setting, "some/model", tmp_path / setting, a, cuda)
        at = cmd.index("crystal_grpo.train.benchmarks.training")
        entry = "grpo" if not setting.startswith("trl") else "trl-reward" if setting.endswith("-cpr") else "trl"
        assert cmd[at + 1] == entry
        overrides = cmd[at + 2 :]
        for flag in ("--config", "--output_dir"):  # the entry's own arguments, not config keys
            i = overrides.index(flag)
            del overrides[i : i + 2]
        assert cmd[cmd.index("--config") + 1] == a.config
        cfg, _ = load_config(a.config, overrides)
        configs[setting] = cfg
        assert cfg.model.name_or_path == "some/model" and cfg.training["max_steps"] == 3
        assert cfg.training["learning_rate"] == 0 and cfg.training["seed"] == 7
        assert (cfg.model.lora is not None) == ("lora" in setting) and cfg.pcgrad == ("pcgrad" in setting)
        assert cfg.model.lora is None or cfg.model.lora.merge_for_generation == ("unmerged" not in setting)
        assert cfg.reward.name == ("answer_only" if "answer" in setting else "cpr")
        assert cfg.training.get("cache_implementation") == ("static" if setting.endswith("-static") else None)
        assert cfg.training.get("use_transformers_continuous_batching", False) == setting.endswith("-cb")
        assert bench.Setting.parse(setting).name() == setting
        assert cfg.reward.step_credit.weight == (bench.STEP_CREDIT_WEIGHT if "credit" in setting else 0.0)
        assert cfg.training["use_cpu"] is (not cuda) and cfg.reward.params["device"] == ("cuda" if cuda else "cpu")
        zero3 = "zero3" in setting
        assert ("zero3_1x1.yaml" in " ".join(cmd[:at])) == (zero3 and cuda)
        assert (cfg.training.get("deepspeed") == "configs/accelerate/zero3.json") == (zero3 and not cuda)
    assert configs["trl-full"].training == configs["plain-full"].training
    assert configs["trl-lora"].model == configs["plain-lora"].model
    assert configs["trl-full-static"].training == configs["plain-full-static"].training
    assert bench.Setting.parse("plain-lora-answer-cb").baseline == "trl-lora-cb"
    assert bench.Setting.parse("plain-full-answer-credit").name(reward="cpr", credit=False) == "plain-full"
    # --model organism: the organism's own config (its data and prompt), exact step matching
    org = argparse.Namespace(**{**vars(a), "config": "organism.yaml", "encoder": "exact"})
    cmd = bench.command("plain-full", "data/organism/warm_start", tmp_path / "org", org, cuda)
    overrides = cmd[cmd.index("crystal_grpo.train.benchmarks.training") + 2 :]
    assert overrides[:2] == ["--config", "organism.yaml"]
    cfg, _ = load_config("organism.yaml", overrides[4:])
    assert cfg.data.system_prompt == "Reply in JSON." and cfg.reward.params["encoder"] == "exact"
    assert cfg.data.train.endswith("organism/data/train.jsonl") and cfg.training["max_steps"] == 3
    for bad in (
        "zero2-full",
        "trl-full-pcgrad",
        "plain-full-pcgrad-answer",
        "plain",
        "trl-lora-unmerged",
        "plain-full-unmerged",
        "plain-full-static-pcgrad",
        "trl-full-cb-static",
        "trl-full-credit",
        "plain-full-pcgrad-credit",
    ):
        with pytest.raises(SystemExit, match="allowed are"):
            bench.command(bad, "m", tmp_path, a, cuda)


def test_every_part_the_parts_clock_times_exists():
    """train/benchmarks/parts.py wraps methods by name, TRL's and transformers' private ones among
    them: a renamed one would silently drop out of the breakdown."""
    import importlib

    from crystal_grpo.train.benchmarks import parts

    for program, (module, timed) in parts.PROGRAMS.items():
        assert callable(importlib.import_module(module).main), program
        for label, owner, path in timed:
            holder = importlib.import_module(owner)
            for name in path.split("."):
                holder = getattr(holder, name)
            assert callable(holder), (program, label, path)


def test_the_parts_clock_gives_each_second_to_the_innermost_part(monkeypatch):
    from crystal_grpo.train.benchmarks import parts

    now = [0.0]
    monkeypatch.setattr(parts.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(parts.time, "process_time", lambda: now[0] / 2)

    class Work:
        def outer(self):
            now[0] += 1
            self.inner()
            now[0] += 2

        def inner(self):
            now[0] += 4

    clock = parts.Clock()
    clock.wrap(Work, "outer", "validation: scoring, files")
    clock.wrap(Work, "inner", "generation")
    clock.enter("other")
    Work().outer()
    now[0] += 8
    clock.leave()
    assert clock.spent == {
        "other": [8.0, 4.0, 1],
        "validation: scoring, files": [3.0, 1.5, 1],
        "validation: generation": [4.0, 2.0, 1],
    }
