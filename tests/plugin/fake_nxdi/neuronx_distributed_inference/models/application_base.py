"""NeuronApplicationBase with NxDI 0.7's constructor, compile(), load(), warmup() and
load_weights() behaviour, over a device double that keeps token ids as its KV cache."""

import json
import os

import torch
from safetensors.torch import load_file, save_file

from neuronx_distributed_inference.models.config import InferenceConfig

COMPILED_MODEL_FILE_NAME = "model.pt"


def normalize_path(path):
    return os.path.join(os.path.normpath(path), "")


def is_compiled(model_path):
    return os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)


class FakeNxDModel:
    """`traced_model.nxd_model`: the per-rank state (KV cache) and the warm-up entry."""

    def __init__(self, state):
        self.state = state
        self.warmup_calls = []

    def forward(self, example):
        self.warmup_calls.append(example)


class TokenMemoryDevice:
    """The compiled model: writes each token id (+1) into its KV slot and answers with
    logits that peak at (sum of the row's context token ids) mod vocab."""

    def __init__(self, neuron_config, num_layers, vocab_size):
        c = neuron_config
        self.block = c.is_block_kv_layout
        shape = ((c.pa_num_blocks, c.pa_block_size, 1, 1) if self.block
                 else (c.max_batch_size, 1, c.seq_len, 1))
        self.nxd_model = FakeNxDModel([
            {f"kv_mgr.past_key_values.{i}": torch.zeros(shape) for i in range(2 * num_layers)}
            for _ in range(c.tp_degree)])
        self.config = c
        self.vocab_size = vocab_size

    @property
    def memory(self):
        return self.nxd_model.state[0]["kv_mgr.past_key_values.0"]

    def _sync_ranks(self):
        for rank_state in self.nxd_model.state[1:]:
            rank_state["kv_mgr.past_key_values.0"].copy_(self.memory)

    def _logits(self, contexts):
        logits = torch.zeros(len(contexts), 1, self.vocab_size)
        for row, context in enumerate(contexts):
            logits[row, 0, int(context.sum()) % self.vocab_size] = 1.0
        return logits

    def run(self, tag, bucket, args):
        input_ids, attention_mask, position_ids, seq_ids = args[:4]
        if self.block:
            contexts = self._run_block(tag, bucket, args)
        else:
            contexts = self._run_contiguous(tag, bucket, input_ids, attention_mask,
                                            position_ids, seq_ids)
        self._sync_ranks()
        return self._logits(contexts)

    def _run_contiguous(self, tag, bucket, input_ids, attention_mask, position_ids, seq_ids):
        memory = self.memory[:, 0, :, 0]
        contexts = []
        for row in range(input_ids.shape[0]):
            seq = int(seq_ids[row])
            if tag == "context_encoding_model":
                count = int(attention_mask[row].sum())
                if count > bucket:
                    raise ValueError(f"{count} tokens do not fit bucket {bucket}")
                positions = position_ids[row, :count]
                memory[seq, positions] = input_ids[row, :count].float() + 1
                length = count
            else:
                position = int(position_ids[row, 0])
                if position >= bucket:
                    raise IndexError(f"NRT: position {position} out of bounds for a "
                                     f"KV bucket of {bucket}")
                memory[seq, position] = float(input_ids[row, 0]) + 1
                length = position + 1
            contexts.append(memory[seq, :length] - 1)
        return contexts

    def _run_block(self, tag, bucket, args):
        input_ids, slot_mapping, block_table = args[0], args[11], args[12]
        num_queries, computed = args[13], args[14]
        flat = self.memory.view(-1)
        size = self.config.pa_block_size
        contexts = []
        for row in range(input_ids.shape[0]):
            start, count = int(computed[row][0]), int(num_queries[row][0])
            new = (input_ids[row, start:start + count] if tag == "context_encoding_model"
                   else input_ids[row, :1])
            for slot, token in zip(slot_mapping[row].tolist(), new.tolist()):
                if slot < 0:
                    continue
                if slot >= flat.numel():
                    raise IndexError(f"NRT: KV slot {slot} out of bounds for "
                                     f"{self.config.pa_num_blocks} blocks of {size}")
                flat[slot] = float(token) + 1
            positions = torch.arange(start + count)
            # NxDI pads (F.pad) the block table with block 0 up to the bucket's width.
            table = torch.nn.functional.pad(
                block_table[row], (0, max(0, -(-(start + count) // size) - block_table.shape[1])))
            slots = table[positions // size] * size + positions % size
            contexts.append(flat[slots] - 1)
        return contexts


class NeuronApplicationBase(torch.nn.Module):
    def __init__(self, model_path: str, config: InferenceConfig = None, neuron_config=None):
        super().__init__()
        model_path = normalize_path(model_path)
        if config is None:
            config = self.get_config_cls().load(model_path)
        if neuron_config is not None:
            config.neuron_config = neuron_config
        self.validate_config(config)
        self.config = config
        self.neuron_config = config.neuron_config
        self.fused_spec_config = config.fused_spec_config
        self.on_device_sampling = self.neuron_config.on_device_sampling_config is not None
        self.model_path = model_path
        self.models = []
        self.traced_model = None
        self.is_compiled = is_compiled(model_path)
        self.is_loaded_to_neuron = False
        self.loaded_weights = None

    @classmethod
    def validate_config(cls, config):
        pass

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls is not implemented")

    @classmethod
    def get_neuron_config_cls(cls):
        return cls.get_config_cls().get_neuron_config_cls()

    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None, dry_run=False):
        compiled_model_path = normalize_path(compiled_model_path)
        self.config.save(compiled_model_path)
        if dry_run:
            return
        graphs = {model.tag: model.neuron_config.buckets for model in self.models}
        with open(compiled_model_path + COMPILED_MODEL_FILE_NAME, "w") as f:
            json.dump(graphs, f)
        if self.neuron_config.save_sharded_checkpoint:
            os.makedirs(compiled_model_path + "weights", exist_ok=True)
            weights = self.checkpoint_loader_fn()
            for rank in range(self.neuron_config.tp_degree):
                save_file(weights, os.path.join(
                    compiled_model_path, f"weights/tp{rank}_sharded_checkpoint.safetensors"))
        self.is_compiled = True

    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None,
             skip_warmup=False):
        compiled_model_path = normalize_path(compiled_model_path)
        path = compiled_model_path + COMPILED_MODEL_FILE_NAME
        if not os.path.isfile(path):
            raise ValueError(f"The provided filename {path} does not exist")
        with open(path) as f:
            graphs = json.load(f)
        for model in self.models:
            if graphs.get(model.tag) != model.neuron_config.buckets:
                raise RuntimeError(f"compiled {model.tag} buckets {graphs.get(model.tag)} "
                                   f"differ from {model.neuron_config.buckets}")
        text = self.config.get_text_config()
        self.traced_model = TokenMemoryDevice(self.neuron_config, text.num_hidden_layers,
                                              text.vocab_size)
        self.load_weights(compiled_model_path)
        for model_wrapper in self.models:
            model_wrapper.model = self.traced_model
        self.is_loaded_to_neuron = True
        if not self.neuron_config.skip_warmup and not skip_warmup:
            self.warmup()

    def warmup(self):
        for model in self.models:
            for example in model.input_generator():
                model.model.nxd_model.forward(example)

    def load_weights(self, compiled_model_path, start_rank_id=None, local_ranks_size=None):
        if self.neuron_config.save_sharded_checkpoint:
            self.loaded_weights = [load_file(os.path.join(
                compiled_model_path, f"weights/tp{rank}_sharded_checkpoint.safetensors"))
                for rank in range(self.neuron_config.tp_degree)]
        else:
            self.loaded_weights = [self.checkpoint_loader_fn()]

    def checkpoint_loader_fn(self, mmap: bool = False):
        model_path = getattr(self.config, "_name_or_path", None)
        if model_path is None or not os.path.exists(model_path):
            model_path = self.model_path
        if self.config.neuron_config.quantized:
            model_path = self.config.neuron_config.quantized_checkpoints_path
            if not os.path.exists(model_path):
                raise FileNotFoundError(f"Quantized checkpoint file not found: {model_path}")
        weights = {}
        for name in sorted(os.listdir(model_path)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(model_path, name)))
        return weights

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: InferenceConfig):
        weights = {}
        for name in sorted(os.listdir(model_path)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(model_path, name)))
        path = config.neuron_config.quantized_checkpoints_path
        os.makedirs(path, exist_ok=True)
        save_file({k: v.to(torch.float16) for k, v in weights.items()},
                  os.path.join(path, "model.safetensors"))
