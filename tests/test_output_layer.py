"""The output layer ``keep_last_layer_dense`` keeps: declared by the model (a tied embedding, under LoRA too),
else found from the first forward pass with a graph (the module nearest the output, wherever it was registered);
tied parameters are one unit; 2-rank training with the presets of a tied causal language model, ours and Hugging
Face's GPT-2 (built from a config, random weights), bare and under LoRA (ours, and PEFT's on GPT-2), and of one
that declares nothing and registers its head first."""

from __future__ import annotations

import importlib.util
import io

import lightning.pytorch as pl
import pytest
import torch
from models import quiet_trainer
from ranks import run_ranks
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.ddp.output_layer import OutputLayerWatch, output_layer_names, registered_last

VOCAB, WIDTH, CONTEXT = 96, 32, 8


class TinyCausalLM(nn.Module):
    """A Hugging Face-style causal language model: token and position embeddings, two blocks of attention and MLP,
    a final norm, and an output projection tied to the token embedding (``get_output_embeddings``)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.ln_f = nn.LayerNorm(WIDTH)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: one parameter, registered under wte

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        h = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            h = block(h, src_mask=mask, is_causal=True)
        return self.lm_head(self.ln_f(h))


class HeadFirstLM(TinyCausalLM):
    """The same language model with an untied head registered before everything else and no declaration: only its
    forward pass says which module is the output layer."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.wpe = nn.Embedding(CONTEXT, WIDTH)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(WIDTH, 2, 4 * WIDTH, dropout=0.0, batch_first=True) for _ in range(2)
        )
        self.ln_f = nn.LayerNorm(WIDTH)

    get_output_embeddings = None  # type: ignore[assignment]


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-4 update ``B A`` (LoRA), B starting at zero."""

    def __init__(self, base: nn.Linear, rank: int = 4) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Linear(base.in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_b.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRAWrapper(nn.Module):
    """What a PEFT wrapper looks like from outside: the model one level down, every base weight frozen, LoRA on the
    blocks' feed-forward layers (it declares no output layer of its own: the model inside does)."""

    def __init__(self, model: TinyCausalLM) -> None:
        super().__init__()
        self.base_model = model.requires_grad_(False)
        for block in model.blocks:
            block.linear1 = LoRALinear(block.linear1)
            block.linear2 = LoRALinear(block.linear2)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.base_model(tokens)


class HeadFirst(nn.Module):
    """No declaration, the logits layer registered last: the registration-order rule."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.out = nn.Linear(16, 3)


def test_a_tied_model_keeps_its_shared_embedding_dense_named_once() -> None:
    model = TinyCausalLM()
    named = list(model.named_parameters())
    assert "lm_head.weight" not in dict(named)  # tied: registered (and exchanged) once, under the embedding
    assert output_layer_names(model, named) == ["wte.weight"]
    assert named[-1][0] == "ln_f.bias"  # what the registration-order rule would have kept
    dense = GradCompStrategy(keep_last_layer_dense=True).dense_parameter_names(named, model)
    assert dense == {"wte.weight"}


def test_under_lora_the_frozen_output_layer_is_not_exchanged_and_the_adapters_are_the_units() -> None:
    model = LoRAWrapper(TinyCausalLM())
    named = list(model.named_parameters())
    trainable = [name for name, p in named if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert output_layer_names(model, named) == []  # declared by the model inside, and frozen
    strategy = GradCompStrategy(keep_last_layer_dense=True, min_compress_numel=0)
    assert strategy.dense_parameter_names(named, model) == frozenset()


def test_a_model_that_declares_nothing_keeps_the_module_of_its_last_registered_parameter() -> None:
    model = HeadFirst()
    named = list(model.named_parameters())
    assert output_layer_names(model, named) == ["out.weight", "out.bias"]
    assert output_layer_names(None, named) == ["out.weight", "out.bias"]
    model.out.requires_grad_(False)  # a frozen head: the last trainable module is the one kept
    assert output_layer_names(model, named) == ["body.weight", "body.bias"]


class Backbone(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.body(x)))


class HeadRegisteredFirst(nn.Module):
    """The head registered before the backbone, and an auxiliary head (through a frozen projection) registered
    last, whose loss is added scaled."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.backbone = Backbone()
        self.aux = nn.Linear(16, 3)
        self.frozen = nn.Linear(3, 3).requires_grad_(False)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.backbone(x)
        logits = self.head(h)
        loss = nn.functional.cross_entropy(logits, y) + 0.3 * nn.functional.cross_entropy(self.frozen(self.aux(h)), y)
        return {"loss": loss, "logits": logits.detach()}


class FunctionalTied(nn.Module):
    """Logits projected with the embedding matrix in the forward itself: no output module, nothing declared."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, WIDTH)
        self.ln_f = nn.LayerNorm(WIDTH)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(self.ln_f(self.wte(tokens)), self.wte.weight)


def _watched(model: nn.Module) -> OutputLayerWatch:
    return OutputLayerWatch(model, list(model.named_parameters()))


def test_the_output_layer_is_found_from_the_first_forward_pass_wherever_it_was_registered() -> None:
    model = HeadRegisteredFirst()
    named = list(model.named_parameters())
    assert registered_last(named) == ["aux.weight", "aux.bias"]
    watch = _watched(model)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        model(x, y)  # no graph (validation, a sanity check): passed by
    assert watch.found is None and watch.watching
    model(x, y)  # the auxiliary head is further from the loss: a scaling and the frozen projection on its way
    assert watch.found == ["head.weight", "head.bias"] and not watch.watching
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())  # gone with the finding

    tied = FunctionalTied()  # the layer norm's output and the matrix are equally far: the matrix used in place wins
    watch = _watched(tied)
    tied(torch.randint(0, VOCAB, (2, CONTEXT)))
    assert watch.found == ["wte.weight"]


class NanoGPTTied(nn.Module):
    """nanoGPT's tie: the embedding registered first takes the head's matrix, which the head still holds."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict({"wte": nn.Embedding(VOCAB, WIDTH), "ln_f": nn.LayerNorm(WIDTH)})
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.transformer.ln_f(self.transformer.wte(tokens)))


class FeaturesThenHead(nn.Module):
    """``forward`` returns features and ``training_step`` applies the head, which is registered first."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(16, 3)
        self.body = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.body(x)))

    def training_step(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": nn.functional.cross_entropy(self.head(self(x)), y), "features": self(x).detach()}


def test_a_shared_matrix_is_named_as_registered_and_a_nested_forward_waits_for_the_outermost() -> None:
    tied = NanoGPTTied()
    assert [name for name, _ in tied.named_parameters()] == ["transformer.wte.weight", "transformer.ln_f.weight",
                                                             "transformer.ln_f.bias"]  # fmt: skip
    watch = _watched(tied)
    tied(torch.randint(0, VOCAB, (2, CONTEXT)))  # the head's output is the logits; its matrix is the embedding's
    assert watch.found == ["transformer.wte.weight"]

    model = FeaturesThenHead()
    watch = _watched(model)
    forward = model.forward

    def redirected(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        model.forward = forward  # as Lightning's _ForwardRedirection: training_step runs inside the outer call
        return model.training_step(x, y)

    model.forward = redirected
    model(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))  # self(x) inside returns the norm's features first
    assert watch.found == ["head.weight", "head.bias"]

    # manual optimization: the backward pass, and with it the first bucket, comes inside the outermost forward,
    # which returns nothing; what the forward inside found (a model whose forward gives the logits) stands
    classifier = HeadRegisteredFirst()
    watch = _watched(classifier)
    seen: list[tuple] = []

    def manual(x: torch.Tensor, y: torch.Tensor) -> None:
        classifier.forward = HeadRegisteredFirst.forward.__get__(classifier)
        classifier(x, y)["loss"].backward()
        seen.append((watch.found, watch.nested_found))

    classifier.forward = manual
    classifier(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    assert seen == [(None, ["head.weight", "head.bias"])] and watch.found is None


def test_a_compiled_model_hides_its_modules_and_keeps_its_last_registered_one() -> None:
    model = HeadRegisteredFirst()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    watch = _watched(compiled)
    compiled(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    # every trainable parameter is one step from the compiled graph's backward: the last registered module
    assert watch.found == ["_orig_mod.aux.weight", "_orig_mod.aux.bias"]


class Declares(nn.Module):
    """Declares ``head`` as its output, whatever the declaration needs (``how``)."""

    def __init__(self, how: str = "plain") -> None:
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.last = nn.Linear(2, 2)
        self.how = how

    def get_output_embeddings(self, *args: object) -> nn.Module | None:
        if self.how == "arguments" and not args:
            raise TypeError("get_output_embeddings() missing 1 required positional argument: 'which'")
        if self.how == "unsupported":
            raise NotImplementedError
        if self.how == "outside":
            return nn.Linear(2, 2)  # a module that is not one of the model's
        return self.head


class TwoModels(nn.Module):
    def __init__(self, frozen_first: bool) -> None:
        super().__init__()
        self.teacher = Declares()
        self.student = Declares()
        if frozen_first:
            self.teacher.requires_grad_(False)


def test_every_outermost_declaration_counts_and_a_failing_one_falls_back_to_registration_order() -> None:
    pair = TwoModels(frozen_first=True)  # a frozen teacher beside a trained student: the student's head
    assert output_layer_names(pair, list(pair.named_parameters())) == ["student.head.weight", "student.head.bias"]
    both = TwoModels(frozen_first=False)  # two trained models: both heads
    assert output_layer_names(both, list(both.named_parameters())) == [
        "teacher.head.weight",
        "teacher.head.bias",
        "student.head.weight",
        "student.head.bias",
    ]
    for how in ("arguments", "unsupported", "outside"):  # no usable declaration: the last registered module
        model = Declares(how)
        assert output_layer_names(model, list(model.named_parameters())) == ["last.weight", "last.bias"], how


def test_the_callbacks_see_the_declared_output_layer_as_dense() -> None:
    from lightning_gradcomp.callbacks._common import compressed_parameters

    module = LanguageModel("tied")
    strategy = GradCompStrategy.from_preset("ddp_topk", min_compress_numel=64)
    compressed = compressed_parameters(strategy, module)
    assert "model.wte.weight" not in compressed and "model.wpe.weight" in compressed


def _gpt2(lora: bool) -> nn.Module:
    """Hugging Face's GPT-2 built from a config (random weights, tied input and output embeddings), LoRA on its
    attention projection through PEFT when asked."""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT + 1, n_embd=WIDTH, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)
    if lora:
        peft = pytest.importorskip("peft")
        lora_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"], fan_in_fan_out=True)
        model = peft.get_peft_model(model, lora_config)
    return model


MODELS = {
    "tied": lambda: TinyCausalLM(),
    "lora": lambda: LoRAWrapper(TinyCausalLM()),
    "gpt2": lambda: _gpt2(lora=False),
    "gpt2-lora": lambda: _gpt2(lora=True),
    "head-first": lambda: HeadFirstLM(),
}


class LanguageModel(pl.LightningModule):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.hugging_face = kind.startswith("gpt2")
        self.model = MODELS[kind]()

    def training_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (tokens,) = batch
        if self.hugging_face:
            return self.model(input_ids=tokens, labels=tokens).loss
        logits = self.model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


def _tokens(seed: int = 0) -> torch.Tensor:
    """Sequences that repeat a short random motif: learnable next tokens."""
    gen = torch.Generator().manual_seed(seed)
    motifs = torch.randint(0, VOCAB, (256, 3), generator=gen)
    return motifs.repeat(1, 3)[:, : CONTEXT + 1]


def _loss(module: LanguageModel) -> float:
    with torch.no_grad():
        return float(module.training_step((_tokens(),), 0))


def _train_each(rank: int, world_size: int, kinds: list[str]) -> dict:
    return {kind: _train(kind, world_size) for kind in kinds}


def _train(kind: str, world_size: int) -> dict:
    results = {}
    for preset in ("ddp_topk", "ddp_terngrad", "ddp_diana"):
        pl.seed_everything(0, verbose=False)
        module = LanguageModel(kind)
        before = _loss(module)
        strategy = GradCompStrategy.from_preset(preset, warmup_steps=1, min_compress_numel=64)
        monitor = CompressionMonitor(print_summary=False, progress_bar=False)
        trainer = quiet_trainer(strategy, world_size, 12, [monitor])
        trainer.fit(module, DataLoader(TensorDataset(_tokens()), batch_size=16))
        hook = strategy.gradcomp_hook
        table = io.StringIO()
        Console(file=table, width=200).print(monitor.summary_table())
        results[preset] = {
            "weights": {k: v.detach().clone() for k, v in module.state_dict().items()},
            "before": before,
            "after": _loss(module),
            "units": [(u.names, u.compressed) for u in hook.units],
            "compressed": sum(s.compressed for s in hook.history),
            "monitor": (monitor.output_layer, table.getvalue()),
        }
    return results


def _installed(kind: str) -> bool:
    """Whether the optional test dependencies a model needs are installed (GPT-2: transformers; its LoRA: peft)."""
    needs = {"gpt2": ("transformers",), "gpt2-lora": ("transformers", "peft")}.get(kind, ())
    return all(importlib.util.find_spec(name) is not None for name in needs)


@pytest.fixture(scope="module")
def trained() -> list[dict]:
    """Every model (those whose dependencies are installed) under each preset, in one launch of 2 ranks."""
    return run_ranks(_train_each, 2, [kind for kind in MODELS if _installed(kind)], init=False, timeout=600)


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_tied_causal_lm_trains_on_two_ranks_with_its_output_layer_dense(kind: str, trained: list[dict]) -> None:
    if not _installed(kind):
        pytest.skip(f"{kind} needs the optional test dependencies (pip install -e '.[test]')")
    ranks = [by_kind[kind] for by_kind in trained]
    outputs = {"gpt2": "model.transformer.wte.weight", "head-first": "model.lm_head.weight"}
    output = outputs.get(kind, "model.wte.weight")
    for preset, first in ranks[0].items():
        other = ranks[1][preset]
        for key, value in first["weights"].items():
            assert torch.equal(value, other["weights"][key]), (preset, key)  # ranks bit-identical
        assert first["after"] < first["before"], preset
        assert first["compressed"] >= 10, preset
        names = [name for unit, _ in first["units"] for name in unit]
        assert len(names) == len(set(names))  # every parameter in one unit, the tied matrix once
        shown, table = first["monitor"]  # the compression monitor says which output layer stayed dense
        assert shown == ([] if kind.endswith("lora") else [output]), preset
        assert f"output layer averaged densely: {output if shown else 'frozen (none)'}" in table, preset
        if kind.endswith("lora"):
            assert names and all(".lora_" in name for name in names), preset  # frozen weights have no unit
        else:
            dense = {name for unit, compressed in first["units"] if not compressed for name in unit}
            assert dense & {name for name in names if "lm_head" in name or "wte" in name} == {output}, preset


def test_hugging_face_gpt2_declares_its_tied_embedding_and_peft_freezes_it() -> None:
    model = _gpt2(lora=False)
    named = list(model.named_parameters())
    assert output_layer_names(model, named) == ["transformer.wte.weight"]
    assert named[-1][0] == "transformer.ln_f.bias"  # what the registration-order rule would have kept
    wrapped = _gpt2(lora=True)
    named = list(wrapped.named_parameters())
    trainable = [name for name, p in named if p.requires_grad]
    assert trainable and all(".lora_" in name for name in trainable)
    assert output_layer_names(wrapped, named) == []


class Classifier(nn.Module):
    """The head registered first; no declaration."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(64, 4)
        self.body = nn.Linear(32, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _a_lone_forward_on_rank_zero(rank: int, world_size: int) -> dict:
    from torch.nn.parallel import DistributedDataParallel

    from lightning_gradcomp import gradcomp_comm_hook, make_hook

    torch.manual_seed(0)
    model = Classifier()
    ddp = DistributedDataParallel(model)
    hook = make_hook(ddp, "ddp_topk", min_compress_numel=100, adaptive="none", density=0.1)
    ddp.register_comm_hook(hook, gradcomp_comm_hook)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(rank))
    if rank == 0:
        model(x)  # a forward with a graph on rank 0 alone (a logger tracing the model): no collective may follow
    torch.distributed.all_reduce(torch.zeros(1))  # the script's own collective: must meet rank 1's
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        optimizer.zero_grad()
        nn.functional.cross_entropy(ddp(x), torch.zeros(16, dtype=torch.long)).backward()
        optimizer.step()
    return {
        "dense": sorted(n for unit in hook.units if not unit.compressed for n in unit.names),
        "weights": {k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def test_ranks_share_rank_zeros_finding_at_the_first_bucket_whatever_forward_passes_came_before() -> None:
    first, second = run_ranks(_a_lone_forward_on_rank_zero, 2, timeout=120)
    assert first["dense"] == second["dense"] == ["body.bias", "head.bias", "head.weight"]
    for name, value in first["weights"].items():
        assert torch.equal(value, second["weights"][name]), name
