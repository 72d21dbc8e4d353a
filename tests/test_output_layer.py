"""The output layer ``keep_last_layer_dense`` keeps: declared by the model (a tied embedding, under LoRA too),
else found from the first forward pass with a graph (the module nearest the output, wherever it was registered);
tied parameters are one unit; 2-rank training with the presets of a tied causal language model, ours and Hugging
Face's GPT-2 (built from a config, random weights), bare and under LoRA (ours, and PEFT's on GPT-2), and of one
that declares nothing and registers its head first."""

from __future__ import annotations

import io

import lightning.pytorch as pl
import pytest
import torch
from ranks import run_ranks
from rich.console import Console
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_gradcomp import GradCompStrategy
from lightning_gradcomp.callbacks import CompressionMonitor
from lightning_gradcomp.output_layer import OutputLayerWatch, output_layer_names, registered_last

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


def _watched(model: nn.Module) -> tuple[OutputLayerWatch, list[list[str]]]:
    found: list[list[str]] = []
    return OutputLayerWatch(model, list(model.named_parameters()), found.append), found


def test_the_output_layer_is_found_from_the_first_forward_pass_wherever_it_was_registered() -> None:
    model = HeadRegisteredFirst()
    named = list(model.named_parameters())
    assert registered_last(named) == ["aux.weight", "aux.bias"]
    watch, found = _watched(model)
    x, y = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        model(x, y)  # no graph (validation, a sanity check): passed by
    assert found == [] and watch.watching
    model(x, y)  # the auxiliary head is further from the loss: a scaling and the frozen projection on its way
    assert found == [["head.weight", "head.bias"]] and not watch.watching
    model(x, y)
    assert len(found) == 1
    assert all(not m._forward_hooks for m in model.modules())  # the hooks went with the finding

    tied = FunctionalTied()  # the layer norm's output and the matrix are equally far: the matrix used in place wins
    _, found = _watched(tied)
    tied(torch.randint(0, VOCAB, (2, CONTEXT)))
    assert found == [["wte.weight"]]


def test_a_compiled_model_hides_its_modules_and_keeps_its_last_registered_one() -> None:
    model = HeadRegisteredFirst()
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    _, found = _watched(compiled)
    compiled(torch.randn(4, 8), torch.tensor([0, 1, 2, 0]))
    # every trainable parameter is one step from the compiled graph's backward: the last registered module
    assert found == [["_orig_mod.aux.weight", "_orig_mod.aux.bias"]]


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


def _train(rank: int, world_size: int, kind: str) -> dict:
    results = {}
    for preset in ("ddp_topk", "ddp_terngrad", "ddp_diana"):
        pl.seed_everything(0, verbose=False)
        module = LanguageModel(kind)
        before = _loss(module)
        strategy = GradCompStrategy.from_preset(preset, warmup_steps=1, min_compress_numel=64)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world_size,
            strategy=strategy,
            max_steps=12,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            callbacks=[monitor := CompressionMonitor(print_summary=False, progress_bar=False)],
        )
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


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_tied_causal_lm_trains_on_two_ranks_with_its_output_layer_dense(kind: str) -> None:
    if kind.startswith("gpt2"):  # skipped here, where the optional test dependencies are missing
        _gpt2(lora=kind.endswith("lora"))
    ranks = run_ranks(_train, 2, kind, init=False, timeout=400)
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
