"""Run configs: numbers as users write them, one-line errors naming key, value and expected
type (every section, ``training`` against GRPOConfig's field types, every reward
parameter), YAML syntax errors, unsafe tags and duplicate keys, ranges, and combinations
PCGrad cannot honour. All of it before any model loads (no model exists in these tests)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
import time

import pytest

from crystal_grpo.train import grpo
from crystal_grpo.train.config.run_config import ConfigError, load_config


def test_scientific_notation_is_a_number_in_files_and_on_the_command_line(tmp_path):
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(
        "model: {name_or_path: m}\ndata: {train: t.jsonl}\n"
        "training: {learning_rate: 1e-5, max_steps: 1e3, warmup_steps: 5E-2}\n"
        "reward: {name: cpr, params: {step_weight: 4e-1, guard_window: 2e3}}\n"
    )
    cfg, _ = load_config(str(cfg_file))
    assert cfg.training == {"learning_rate": 1e-5, "max_steps": 1000, "warmup_steps": 0.05}
    assert type(cfg.training["max_steps"]) is int and type(cfg.reward.config.guard_window) is int
    assert cfg.reward.params == {"step_weight": 0.4, "guard_window": 2000}
    cfg, _ = load_config("tiny", ["--training.learning_rate", "5e-6", "--reward.params.threshold=3.5e-1"])
    assert cfg.training["learning_rate"] == 5e-6 and cfg.reward.params["threshold"] == 0.35


@pytest.mark.parametrize(
    "override, message",
    [
        (["--training.learning_rate", "fast"], "training.learning_rate: invalid value 'fast'; expected float"),
        (["--training.max_steps", "two"], "training.max_steps: invalid value 'two'; expected int"),
        (["--training.num_generations", "3.5"], "training.num_generations: invalid value 3.5; expected int or null"),
        (["--training.bf16", "1"], "training.bf16: invalid value 1; expected bool or null"),
        (["--training.temperature", ".nan"], "training.temperature: invalid value nan; expected float (a finite"),
        (["--training.report_to", "{a: 1}"], "training.report_to: invalid value {'a': 1}; expected null or str or"),
        (["--training.lr_scheduler_type", "3"], "training.lr_scheduler_type: invalid value 3; expected SchedulerType"),
        (["--training.num_generations", "1"], "training.num_generations: invalid value 1; expected x >= 2"),
        (["--training.learning_rate", "-1e-5"], "training.learning_rate: invalid value -1e-05; expected x >= 0"),
        (["--reward.params.step_weight", "0.4e"], "reward.params.step_weight: invalid value '0.4e'; expected float"),
        (["--reward.params.threshold", "1.5"], "reward.params.threshold: invalid value 1.5; expected -1 <= x <= 1"),
        (["--reward.params.guard_window", "0"], "reward.params.guard_window: invalid value 0; expected x >= 1"),
        (["--reward.params.verbosity_guard", "maybe"], "reward.params.verbosity_guard: invalid value 'maybe'"),
        (["--reward.params.device", "0"], "reward.params.device: invalid value 0; expected str or null"),
        (
            ["--reward.params.matcher", "hungarian"],
            "reward.params.matcher: invalid value 'hungarian'; expected one of",
        ),
        (["--validation.eval_steps", "-1"], "validation.eval_steps: invalid value -1; expected x >= 0"),
        (["--validation.max_new_tokens", "0"], "validation.max_new_tokens: invalid value 0; expected x >= 1"),
        (["--data.validation_fraction", "1.0"], "data.validation_fraction: invalid value 1.0; expected 0 <= x < 1"),
        (["--stability.max_consecutive_nonfinite", "0"], "stability.max_consecutive_nonfinite: invalid value 0"),
        (["--model.lora", "{r: 0}"], "model.lora.r: invalid value 0; expected x >= 1"),
        (["--curriculum", "{c0: 0}"], "curriculum.c0: invalid value 0; expected 0 < x <= 1"),
        (["--pcgrad", "yes please"], "pcgrad: invalid value 'yes please'; expected bool"),
        (
            ["--phases", "[{name: p2, overrides: {training: {max_steps: x}}}]"],
            "phases[p2].overrides.training.max_steps: invalid value 'x'; expected int",
        ),
        (
            ["--phases", "[{name: p2, overrides: {reward: {name: cpr, params: {answer_weight: heavy}}}}]"],
            "phases[p2].overrides.reward.params.answer_weight: invalid value 'heavy'; expected float",
        ),
        (
            ["--pcgrad", "true", "--training.use_liger_kernel", "true"],
            "training.use_liger_kernel: pcgrad: true cannot be combined with use_liger_kernel",
        ),
        (
            ["--pcgrad", "true", "--training.multi_objective_aggregation", "normalize_then_sum"],
            "training.multi_objective_aggregation: 'normalize_then_sum' cannot be combined with pcgrad: true",
        ),
        (["--training.seed", "{a: 1"], "override --training.seed:1:6: invalid YAML"),
        (
            ["--training.max_steps", "0"],
            "training.max_steps: invalid value 0; expected -1 (train num_train_epochs) or an integer >= 1",
        ),  # transformers trains one step
        (
            ["--reward.params.step_weight", "-0.35"],
            "reward.params.step_weight: invalid value -0.35; a reward weight "
            "must be >= 0 (set reward.params.negative_weights: true",
        ),
        (["--training.reward_weights", "[1, -1]"], "training.reward_weights: invalid value [1, -1]; a reward weight"),
        (["--data.long_prompts", "truncate"], "data.long_prompts: invalid value 'truncate'; expected one of 'skip'"),
        (
            ["--dynamic_sampling.mode", "drop"],
            "dynamic_sampling.mode: invalid value 'drop'; expected one of 'none', 'mask', 'refill'",
        ),
        (["--dynamic_sampling.mode", "off"], "dynamic_sampling.mode: invalid value False; expected one of 'none'"),
        (
            ["--dynamic_sampling.max_num_gen_batches", "0"],
            "dynamic_sampling.max_num_gen_batches: invalid value 0; expected x >= 1",
        ),
        (["--dynamic_sampling.min_std", "-0.1"], "dynamic_sampling.min_std: invalid value -0.1; expected x >= 0"),
        (
            ["--dynamic_sampling", "{mode: mask, metric: objectives}"],
            "dynamic_sampling.metric: 'objectives' filters each of PCGrad's two losses on its own objective and needs "
            "pcgrad: true",
        ),
        (
            ["--dynamic_sampling.mode", "refill", "--training.scale_rewards", "batch"],
            "training.scale_rewards: 'batch' cannot be combined with dynamic_sampling.mode: refill",
        ),
        (
            ["--dynamic_sampling.mode", "mask", "--training.multi_objective_aggregation", "normalize_then_sum"],
            "training.multi_objective_aggregation: 'normalize_then_sum' cannot be combined with "
            "dynamic_sampling.mode: mask",
        ),
        (
            ["--phases", "[{name: warm, trainer: sft, overrides: {dynamic_sampling: {mode: mask}}}]"],
            "phases[warm].overrides.dynamic_sampling.mode: set for an SFT phase",
        ),
    ],
)
def test_bad_values_stop_with_one_line_naming_key_value_and_type(override, message, capsys):
    assert grpo.main(["--config", "tiny.yaml", *override]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_use_vllm_without_vllm_is_one_line_before_anything_loads(capsys):
    assert grpo.main(["--config", "tiny.yaml", "--training.use_vllm", "true"]) == 2
    err = capsys.readouterr().err.strip()
    assert "training.use_vllm: true, but vLLM is not installed; on a CUDA GPU machine, make setup-vllm" in err
    assert "\n" not in err


def _installed_vllm(folder, version: str) -> None:
    """A distribution named vllm at ``version`` on ``folder`` (an empty package with its metadata):
    what --check reads of an installed vLLM, which cannot be installed on this CPU machine."""
    (folder / "vllm").mkdir()
    (folder / "vllm" / "__init__.py").write_text("")
    info = folder / f"vllm-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    importlib.invalidate_caches()


@pytest.mark.parametrize("version, refused", [("0.33.0", True), ("0.21.0", True), ("0.31.0", False)])
def test_use_vllm_with_a_vllm_release_trl_does_not_support_is_refused_at_check(
    version, refused, tmp_path, monkeypatch, capsys
):
    """vLLM 0.33 (what an unbounded pip install takes) or 0.21 against TRL 1.16's vllm extra
    (>=0.22.0,<=0.31.0, read from TRL's metadata): one line pointing at make setup-vllm."""
    from crystal_grpo.train.models.generation import trl_vllm_range, vllm_problem

    _installed_vllm(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert trl_vllm_range() == "<=0.31.0,>=0.22.0"
    code = grpo.main(["--config", "tiny.yaml", "--training.use_vllm", "true", "--check"])
    err = capsys.readouterr().err.strip()
    if refused:
        assert code == 2 and "\n" not in err
        assert (
            f"training.use_vllm: true, but vLLM {version} is installed and TRL 1.16.0 supports "
            "vllm<=0.31.0,>=0.22.0; on a CUDA GPU machine, make setup-vllm"
        ) in err
    else:
        assert vllm_problem() is None and "use_vllm" not in err


def test_negative_weights_pass_when_the_config_says_they_are_meant():
    cfg, _ = load_config(
        "tiny.yaml",
        [
            "--reward.params.step_weight",
            "-0.35",
            "--reward.params.negative_weights",
            "true",
            "--training.reward_weights",
            "[1, -1]",
        ],
    )
    assert cfg.reward.params["step_weight"] == -0.35


def test_values_of_any_grpo_config_type_pass():
    cfg, _ = load_config(
        "tiny",
        [
            "--training.report_to",
            "[wandb, tensorboard]",
            "--training.lr_scheduler_type",
            "cosine",
            "--training.lr_scheduler_kwargs",
            "{num_cycles: 2}",
            "--training.reward_weights",
            "[1, 0.5]",
            "--training.save_total_limit",
            "null",
            "--training.gradient_checkpointing_kwargs",
            "{use_reentrant: false}",
        ],
    )
    assert cfg.training["reward_weights"] == [1, 0.5] and cfg.training["lr_scheduler_kwargs"] == {"num_cycles": 2}


def _write(tmp_path, text: str):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_yaml_syntax_error_names_file_line_and_column(tmp_path, capsys):
    path = _write(tmp_path, "model:\n  name_or_path: [x\ndata: {train: t}\n")
    assert grpo.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: {path}:3:5: invalid YAML: expected ',' or ']'") and "\n" not in err


def test_unsafe_tags_are_refused_and_never_run(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = _write(tmp_path, f"model: !!python/object/apply:os.system ['touch {marker}']\n")
    assert grpo.main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{path}:1:8: invalid YAML: could not determine a constructor for the tag" in err
    assert "python/object/apply:os.system" in err and "\n" not in err
    assert not marker.exists()


@pytest.mark.parametrize(
    "text, line, key",
    [
        (
            "model: {name_or_path: a}\ndata: {train: t}\nmodel: {name_or_path: b}\n",
            3,
            "'model' (first given on line 1)",
        ),
        (
            "training:\n  learning_rate: 1e-5\n  max_steps: 3\n  learning_rate: 2e-5\n",
            4,
            "'learning_rate' (first given on line 2)",
        ),
        ("training: {max_steps: 3, max_steps: 4}\n", 1, "'max_steps' (first given on line 1)"),
    ],
)
def test_duplicate_keys_are_an_error(tmp_path, text, line, key):
    path = _write(tmp_path, text)
    with pytest.raises(
        ConfigError,
        match=rf"^{re.escape(str(path))}:{line}:\d+: invalid YAML: duplicate key "
        rf"{re.escape(key)}$",
    ):
        load_config(str(path))


@pytest.mark.parametrize(
    "override, first",
    [
        (["--training.max_steps", "3", "--training.max_steps", "4"], "--training.max_steps 3"),
        (["--training", "{max_steps: 3}", "--training.max_steps=4"], "--training {max_steps: 3}"),
        (["--training.max_steps", "3", "--training", "{max_steps: 4}"], "--training.max_steps 3"),
    ],
)
def test_an_override_given_twice_is_an_error_as_a_key_given_twice_in_yaml(override, first, capsys):
    """The last one won without a word."""
    assert grpo.main(["--config", "tiny.yaml", *override]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err.startswith(
            f"config error: override --training.max_steps is given twice on the command line ({first}, then --training"
        )
        and err.endswith("give it once")
        and "\n" not in err
    )


@pytest.mark.parametrize(
    "args, key",
    [
        (["--output_dir", ""], "--output_dir"),
        (["--output_dir", " "], "--output_dir"),
        (["--training.output_dir", "''"], "training.output_dir"),
    ],
)
def test_an_empty_output_dir_is_an_error_not_the_default_folder(args, key, capsys):
    assert grpo.main(["--config", "tiny.yaml", *args, "--check"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"config error: {key} is empty (") and "leave it out for runs/tiny" in err
    assert "\n" not in err


def test_two_run_folders_on_the_command_line_are_refused(capsys, tmp_path):
    """--training.output_dir B was silently overridden by --output_dir A; the same folder twice is one."""
    argv = ["--config", "tiny.yaml", "--check", "--output_dir", str(tmp_path / "a")]
    assert grpo.main([*argv, "--training.output_dir", str(tmp_path / "b")]) == 2
    assert capsys.readouterr().err == (
        f"config error: --output_dir {tmp_path / 'a'} and --training.output_dir {tmp_path / 'b'} name two run "
        "folders; give one\n"
    )
    grpo.main([*argv, "--training", f"{{output_dir: {tmp_path}/a/}}"])  # one folder, given twice
    assert "name two run folders" not in capsys.readouterr().err


def test_a_section_given_in_parts_on_the_command_line_is_merged():
    cfg, _ = load_config("tiny", ["--training.max_steps", "3", "--training", "{learning_rate: 0.5}"])
    assert cfg.training["max_steps"] == 3 and cfg.training["learning_rate"] == 0.5  # (max_steps was dropped)


def test_config_file_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="the top level must be a mapping"):
        load_config(str(_write(tmp_path, "- a\n- b\n")))


@pytest.mark.parametrize(
    "override, message",
    [
        (["--reward.nme", "cpr"], "unknown key 'reward.nme' (did you mean 'name'?); allowed keys: name, params"),
        (["--reward.name", "prm"], "reward.name: invalid value 'prm'; expected one of 'format', 'answer_only'"),
        (["--training.learning_rat", "1"], "training: unknown key 'learning_rat'"),
        (["--reward.params.answer_wieght", "1"], "unknown key(s) 'answer_wieght' for reward 'cpr'"),
        (["--validation.batch_size", "eight"], "validation.batch_size: invalid value 'eight'; expected int"),
        (["--training.num_generations", "3"], "training.num_generations: 3 completions of a prompt do not fit whole"),
        (
            ["--training.generation_batch_size", "8", "--training.per_device_train_batch_size", "3"],
            "training: generation_batch_size (8) must be divisible by the global batch size (3)",
        ),  # TRL's own check
    ],
)
def test_config_errors_name_key_and_allowed_values(override, message, capsys, tiny_lm_path):
    # the model folder exists, so what is reported is the bad value (TRL's own checks run before loading)
    assert grpo.main(["--config", "tiny.yaml", "--model.name_or_path", str(tiny_lm_path), *override]) == 2
    assert message in capsys.readouterr().err


def test_config_name_resolution_and_overrides(repo_root):
    cfg, _ = load_config("tiny", ["--training.max_steps=7", "--reward.params.threshold", "0.5"])
    assert cfg.training["max_steps"] == 7 and cfg.reward.params["threshold"] == 0.5
    with pytest.raises(ConfigError, match="not found"):
        load_config("no_such_config.yaml")
    with pytest.raises(ConfigError, match=r"^config 'configs' is a folder; give one YAML file in it, or in configs/"):
        load_config("configs")  # was "not found", of a folder that is there
    for name in ("cpr_curriculum", "cpr", "composite", "answer_only", "demo", "tiny"):
        load_config(name)


def test_check_validates_and_finds_everything_then_stops(tmp_path, tiny_lm_path, capsys):
    """``--check``: the config and everything it names, nothing loaded or written; a missing
    file is the same one-line problem list a run would print."""
    out = tmp_path / "run"
    args = ["--config", "tiny.yaml", "--model.name_or_path", str(tiny_lm_path), "--output_dir", str(out), "--check"]
    assert grpo.main(args) == 0
    assert "config valid and everything it names found" in capsys.readouterr().out
    assert not out.exists()
    assert grpo.main([*args, "--data.train", str(tmp_path / "missing.jsonl")]) == 2
    assert f"data.train: no such file or folder '{tmp_path / 'missing.jsonl'}'" in capsys.readouterr().err


def test_check_refuses_pcgrad_under_zero1_and_zero2(tmp_path, tiny_lm_path, repo_root, capsys, monkeypatch):
    """pcgrad: true with a ZeRO-1/2 DeepSpeed config is one line at ``--check`` (why, and what
    to use instead), whether the config comes from training.deepspeed or from accelerate launch."""
    base = [
        "--config",
        "tiny.yaml",
        "--model.name_or_path",
        str(tiny_lm_path),
        "--output_dir",
        str(tmp_path / "r"),
        "--check",
    ]
    zero = {stage: str(repo_root / "configs" / "accelerate" / f"zero{stage}.json") for stage in (2, 3)}
    assert grpo.main([*base, "--pcgrad", "true", "--training.deepspeed", zero[2]]) == 2
    err = capsys.readouterr().err
    assert "pcgrad: true cannot run under DeepSpeed ZeRO-2: " in err and "use ZeRO-3" in err
    assert len([line for line in err.splitlines() if "pcgrad" in line]) == 1
    assert grpo.main([*base, "--pcgrad", "true", "--training.deepspeed", zero[3]]) == 0
    assert grpo.main([*base, "--pcgrad", "false", "--training.deepspeed", zero[2]]) == 0
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", zero[2])  # accelerate launch --config_file zero2_1x4.yaml
    assert grpo.main([*base, "--pcgrad", "true"]) == 2
    assert "cannot run under DeepSpeed ZeRO-2" in capsys.readouterr().err
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "1")
    assert grpo.main([*base, "--pcgrad", "true"]) == 2
    assert "cannot run under DeepSpeed ZeRO-1" in capsys.readouterr().err


def test_help_shows_the_papers_recipe_and_training_uses_it(capsys, tmp_path):
    from crystal_grpo.train.config.run_config import PaperRecipe

    with pytest.raises(SystemExit):
        grpo.main(["--help"])
    text = capsys.readouterr().out
    assert "--training.beta  float (a finite number) = 0.04" in text and "--training.loss_type  str = 'grpo'" in text
    assert "--dynamic_sampling.mode  one of 'none', 'mask', 'refill' = 'none'" in text
    assert "--dynamic_sampling.max_num_gen_batches  int = 3 (x >= 1)" in text
    cfg, _ = load_config("tiny.yaml")
    cfg.training = {k: v for k, v in cfg.training.items() if k not in ("beta", "temperature", "seed")}
    args = grpo.training_args(cfg, tmp_path, {"use_cpu": True})
    assert (args.beta, args.temperature, args.top_k, args.loss_type, args.seed) == (
        PaperRecipe.beta,
        PaperRecipe.temperature,
        PaperRecipe.top_k,
        PaperRecipe.loss_type,
        PaperRecipe.seed,
    )


def test_each_section_is_typed_once_and_the_code_gets_that_object(repo_root):
    """reward.params become the reward's typed config once, at load; each phase's config is
    made once by validation; training, preflight and the reward module use those objects."""
    from crystal_grpo.rewards import CompositeConfig, CPRConfig
    from crystal_grpo.train.config.run_config import phase_configs
    from crystal_grpo.typed import to_dict

    cfg, _ = load_config(
        "cpr_curriculum",
        [
            "--reward.params.step_weight",
            "4e-1",
            "--reward.params.device",
            "cpu",
            "--reward.params.encoder",
            "packaged:all-MiniLM-L6-v2",
        ],
    )
    p1, p2 = phase_configs(cfg)
    assert (p1, p2) == (cfg.phases[0].config, cfg.phases[1].config) and phase_configs(cfg)[1] is p2
    assert type(p2.reward.config) is CPRConfig and p2.reward.config.step_weight == 0.4
    assert p1.reward.name == "answer_only" and not hasattr(p1.reward.config, "step_weight")
    module = p2.reward.build()
    assert module.config is p2.reward.config and module.scorer.threshold == p2.reward.config.threshold
    # derived objects are not config keys: the record, --help and the phases' merge leave them out
    assert "config" not in to_dict(cfg)["reward"] and "config" not in to_dict(cfg)["phases"][0]
    with pytest.raises(ConfigError, match="unknown key 'reward.config'"):
        load_config("composite", ["--reward.config", "{}"])
    assert type(load_config("composite")[0].reward.config) is CompositeConfig


def test_loading_and_checking_a_config_imports_neither_torch_nor_trl(repo_root, tmp_path):
    """Validation reads TRL's fields from train/config/trl_fields_table.py and the rewards' config classes
    without torch; ``--check`` therefore loads none of the heavy packages (nor for a bf16
    config on a machine without a GPU device node: composite.yaml asks for bfloat16), and
    neither does it with a TRL/transformers other than the table's (an upgrade): one warning."""
    from crystal_grpo.train.config.preflight import gpu_device_nodes

    heavy = ("torch", "trl", "transformers", "datasets", "peft", "sentence_transformers", "accelerate")
    upgraded = "trl_fields.installed_versions = lambda: {'trl': '1.16.0', 'transformers': '5.0.0'}; "
    for config, setup in (("demo", ""), ("tiny", ""), ("composite", ""), ("tiny", upgraded)):
        code = (
            "import sys; from crystal_grpo.train import grpo; "
            "from crystal_grpo.train.config import training_section as trl_fields; "
            f"{setup}code = grpo.main(sys.argv[1:]); "
            f"print(code, sorted(m for m in {heavy!r} if m in sys.modules))"
        )
        args = ["--config", config, "--output_dir", str(tmp_path / "r"), "--check"]
        args += ["--model.dtype", "float32"] if gpu_device_nodes() else []  # then torch is asked about the GPU
        done = subprocess.run(
            [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=repo_root, timeout=120
        )
        assert done.stdout.splitlines()[-1].split(" ", 1)[1] == "[]", (config, setup, done.stdout)
        stale = [line for line in done.stderr.splitlines() if "TRL's field table" in line]
        assert len(stale) == (1 if setup else 0), done.stderr
        if setup:
            assert "installed: trl 1.16.0, transformers 5.0.0" in stale[0]


def test_a_stale_training_schema_checks_keys_it_lacks_against_the_installed_trl(monkeypatch):
    """A TRL or transformers other than the table's: the table still answers (no import); a
    field the table lacks (one added upstream since) is looked up in the installed classes
    rather than refused, and checked against their type."""
    from crystal_grpo.train.config import training_section as trl_fields
    from crystal_grpo.train.config import trl_fields_table as trl_schema

    table = {k: v for k, v in trl_schema.GRPO.items() if k != "weight_decay"}
    monkeypatch.setattr(trl_schema, "GRPO", table)
    monkeypatch.setattr(trl_fields, "installed_versions", lambda: dict(trl_schema.VERSIONS))  # whichever lock's set
    with pytest.raises(ConfigError, match="training: unknown key 'weight_decay'"):
        load_config("tiny", ["--training.weight_decay", "0.1"])  # current table: what it lacks is unknown
    monkeypatch.setattr(trl_fields, "installed_versions", lambda: {"trl": "0.0", "transformers": "0.0"})
    assert trl_fields.training_field_types("grpo") is table
    cfg, _ = load_config("tiny", ["--training.weight_decay", "0.1"])
    assert cfg.training["weight_decay"] == 0.1
    with pytest.raises(ConfigError, match="training.weight_decay: invalid value 'x'; expected float"):
        load_config("tiny", ["--training.weight_decay", "x"])
    with pytest.raises(ConfigError, match="training: unknown key 'weight_decayy'"):
        load_config("tiny", ["--training.weight_decayy", "0.1"])


def test_precision_check_asks_torch_only_where_a_gpu_may_be(tmp_path, monkeypatch):
    """No GPU device node: the bf16 problem without loading torch; with one, torch decides."""
    import torch

    from crystal_grpo.train.config import preflight

    cfg, _ = load_config(
        "tiny", ["--model.dtype", "bfloat16", "--training.bf16", "true", "--training.use_cpu", "false"]
    )
    monkeypatch.setattr(preflight, "GPU_DEVICE_NODES", (str(tmp_path / "nvidia0"),))
    fast = preflight.precision_problem(cfg)
    assert fast.startswith("training.bf16: true needs a CUDA GPU and this machine has none")
    (tmp_path / "nvidia0").touch()
    asked = preflight.precision_problem(cfg)
    if torch.cuda.is_available():
        assert asked is None or "has no bf16" in asked
    else:
        assert asked == fast


def _laughs(levels: int) -> str:
    """The "billion laughs": each level a list of nine aliases of the one before."""
    lines = [
        "model:",
        "  name_or_path: data/organism/warm_start",
        "  init_kwargs:",
        "    l0: &l0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]",
    ]
    lines += [f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize(
    "text, said",
    [
        (
            _laughs(9),
            "the YAML expands to 490,329,058 values through its aliases (*name), more than 100,000: a config "
            "holds a few hundred",
        ),
        (
            "model:\n  init_kwargs: &k {self: *k}\n",
            "a YAML alias (*name) refers to a value that holds it: a config cannot hold itself",
        ),
    ],
    ids=["billion_laughs", "holds_itself"],
)
def test_yaml_aliases_that_explode_or_loop_are_one_line(tmp_path, text, said):
    """9 levels of 9 aliases passed --check, then the run hung writing run.json (490 million
    values); an alias inside its own value ended in RecursionError (second hostile set)."""
    path = tmp_path / "x.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == f"{path}: {said}"
    small = tmp_path / "small.yaml"
    small.write_text(_laughs(3) + "data: {train: data/wordproblems/train.jsonl}\n")
    assert load_config(str(small))[0].model.init_kwargs["l1"][0] == ["lol"] * 9  # aliases as such are fine


@pytest.mark.parametrize(
    "items, said",
    [
        (5_000_000, "{path}: 10.0 MB, more than a config holds (at most 1.0 MB is read; a config is a few KB)"),
        (400_000, "{path}: holds more than 100,000 values: a config holds a few hundred"),
    ],
    ids=["10_MB", "400k_values"],
)
def test_a_huge_yaml_is_refused_early_naming_its_size(tmp_path, items, said):
    """A 10 MB YAML holding a plain 5-million-item list: 120 s and 3.3 GB, then an error blaming
    aliases (*name), of which it had none. Its size is read first; a file under the bound is
    counted as it is parsed, and stops at the bound (within seconds)."""
    path = tmp_path / "x.yaml"
    path.write_text("model:\n  init_kwargs:\n    x: [" + ",".join(["1"] * items) + "]\n")
    start = time.process_time()
    with pytest.raises(ConfigError) as err:
        load_config(str(path))
    assert str(err.value) == said.format(path=path)
    assert time.process_time() - start < 10  # (CPU time: a busy machine does not inflate it)


def test_reward_name_help_names_every_registered_reward():
    """The help is generated from the registry: a reward added to REWARDS is listed."""
    import dataclasses

    from crystal_grpo.rewards import REWARDS
    from crystal_grpo.train.config.run_config import RewardSection

    help_text = next(f for f in dataclasses.fields(RewardSection) if f.name == "name").metadata["help"]
    assert f"REWARDS: {', '.join(REWARDS)};" in help_text and len(REWARDS) >= 7


def test_validate_returns_a_normalised_copy_and_leaves_its_input_alone():
    """load_config's result is validate's copy: the resume path taken out of training, the reward
    typed; the config it was given keeps what it held."""
    from crystal_grpo.train.config.run_config import RunConfig, validate
    from crystal_grpo.typed import from_dict

    _, raw = load_config("tiny", ["--training.resume_from_checkpoint", "latest"])
    given = from_dict(RunConfig, raw)
    before = repr(given)
    checked = validate(given)
    assert repr(given) == before and given.training["resume_from_checkpoint"] == "latest"
    assert checked is not given and checked.resume_from_checkpoint == "latest"
    assert "resume_from_checkpoint" not in checked.training and checked.reward.config is not None
