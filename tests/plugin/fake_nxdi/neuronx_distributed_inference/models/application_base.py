"""models/application_base.py: NeuronApplicationBase's constructor, compile(), load(),
warmup(), load_weights() and to_cpu(). compile() traces every ModelWrapper in
`self.models`, in order, each from its own config (get_builder adds each under its tag):
its buckets (the shapes of its input_generator examples, which is what NxD's router
will accept) and whether its graphs return logits (its config's output_logits); load()
builds the traced model of _nxd_runtime and hands it to every ModelWrapper (with fused
speculation, the draft's NeuronConfig and depth too; its weights are loaded beside the
target's under "draft_model." / "target_model.", application_base.py
checkpoint_loader_fn, ef2731e lines 660-673; an EAGLE draft drafts right only as NxDI's
EAGLE draft, see _eagle_misfit). to_cpu()
builds NxDI's eager submodels only as far as the CPU mode's set-up goes (which module
each wrapper gets, the config and size attributes it starts with, its KV cache
parameters); their forward records those attributes rather than computing (see
EagerModel)."""

import json
import os
import shutil
import time

import torch
from safetensors.torch import load_file, save_file

from neuronx_distributed_inference._nxd_runtime import NxDModel, TracedModel, shape_key
from neuronx_distributed_inference.models.config import InferenceConfig

COMPILED_MODEL_FILE_NAME = "model.pt"


def normalize_path(path):
    return os.path.join(os.path.normpath(path), "")


def is_compiled(model_path):
    return os.path.isfile(model_path + COMPILED_MODEL_FILE_NAME)


def _trace_barrier():
    """See NeuronApplicationBase._trace (test instrumentation)."""
    given = os.environ.get("FAKE_NXDI_TRACE_BARRIER")
    if not given:
        return
    folder, count = given.rsplit(":", 1)
    open(os.path.join(folder, str(os.getpid())), "w").close()
    deadline = time.monotonic() + 120
    while len(os.listdir(folder)) < int(count) and time.monotonic() < deadline:
        time.sleep(0.05)


class KVCacheManager(torch.nn.Module):
    """modules/kvcache/kv_cache_manager.py: the cache as `past_key_values`, a
    ParameterList that NxDI's CPU mode replaces tensor by tensor (`.data = ...`,
    model_base._copy_past_key_values)."""

    def __init__(self, num_layers):
        super().__init__()
        self.past_key_values = torch.nn.ParameterList(
            [torch.nn.Parameter(torch.zeros(1), requires_grad=False)
             for _ in range(2 * num_layers)])


class EagerModel(torch.nn.Module):
    """The eager NeuronBaseModel to_cpu() hands a wrapper, as far as the CPU mode's
    set-up reaches it: the config it is built from (NeuronBaseModel.forward reads its
    output_logits at each call, model_base.py ef2731e line 1018), its KV cache manager,
    and the size attributes it is built with (NeuronBaseModel.__init__, lines 85-87:
    n_positions = seq_len, n_active_tokens from its config, prefix_size 0), which
    tracing would set per bucket. A call records them and the attention mask's dtype
    (test instrumentation); it computes nothing."""

    def __init__(self, neuron_config, num_layers):
        super().__init__()
        self.neuron_config = neuron_config
        self.kv_mgr = KVCacheManager(num_layers)
        self.n_positions = neuron_config.n_positions
        self.n_active_tokens = neuron_config.n_active_tokens
        self.prefix_size = 0
        self.calls = []

    def forward(self, *args):
        if self.training:  # neuronx-distributed parallel_layers/layers.py ParallelEmbedding
            raise RuntimeError("`pad=True` is only supported for inference. Set model.eval()")
        self.calls.append({"n_positions": self.n_positions,
                           "n_active_tokens": self.n_active_tokens,
                           "prefix_size": self.prefix_size, "mask_dtype": args[1].dtype,
                           "output_logits": self.neuron_config.output_logits})


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
        # ef2731e application_base.py 100-101
        if self.neuron_config.lora_config is not None:
            from neuronx_distributed_inference.modules.lora_serving import LoraModelManager

            self.lora_model_manager = LoraModelManager(self.neuron_config.lora_config)

    @classmethod
    def validate_config(cls, config):
        """application_base.py validate_config (ef2731e lines 203-216)."""
        if not hasattr(config, "neuron_config"):
            raise ValueError("Config must include a NeuronConfig")
        if getattr(config, "fused_spec_config", None) is not None:
            if (config.fused_spec_config.draft_config.neuron_config.torch_dtype
                    != config.neuron_config.torch_dtype
                    and getattr(config.neuron_config, "cast_type", "config") == "config"):
                raise ValueError(
                    "cast-type must be set to 'as-declared' to be able to run different "
                    "precisions for draft and target model!")

    @classmethod
    def get_config_cls(cls):
        raise NotImplementedError("get_config_cls is not implemented")

    @classmethod
    def get_neuron_config_cls(cls):
        return cls.get_config_cls().get_neuron_config_cls()

    def compile(self, compiled_model_path, debug=False, pre_shard_weights_hook=None, dry_run=False):
        compiled_model_path = normalize_path(compiled_model_path)
        self._check_fused_spec_model()
        self.config.save(compiled_model_path)
        if dry_run:
            return
        # get_builder (ef2731e line 150): the ModelBuilder's compiler_workdir
        graphs = self._trace(os.environ.get("BASE_COMPILE_WORK_DIR", "/tmp/nxd_model/"))
        with open(compiled_model_path + COMPILED_MODEL_FILE_NAME, "w") as f:
            json.dump(graphs, f)
        if self.neuron_config.save_sharded_checkpoint:
            self._shard_weights(compiled_model_path)
        self.is_compiled = True

    def _shard_weights(self, compiled_model_path):
        """shard_weights (ef2731e lines 240-265) with save_sharded_checkpoint: the
        checkpoint as the device gets it, the start adapters' LoRA weights among it
        (neuronx-distributed trace.py shard_children calls the model's
        update_weights_for_lora: lora_ckpt_paths at their device slots), per rank; with
        dynamic_multi_lora, the CPU adapters pre-sharded too, which asserts there is one
        (lora_checkpoint.py _shard_cpu_weights, `assert len(adapter_names) > 0`)."""
        os.makedirs(compiled_model_path + "weights", exist_ok=True)
        from neuronx_distributed_inference.quantization import cast_to_parameters

        weights = cast_to_parameters(self.checkpoint_loader_fn(), self)
        lora = self.neuron_config.lora_config
        if lora is not None:
            from neuronx_distributed_inference.modules.lora_serving.lora_model import MODULE

            weights[MODULE] = self.lora_model_manager.device_weights()
            if lora.dynamic_multi_lora:
                assert len(lora.lora_ckpt_paths_cpu) > 0
        for rank in range(self.neuron_config.tp_degree):
            save_file(weights, os.path.join(
                compiled_model_path, f"weights/tp{rank}_sharded_checkpoint.safetensors"))

    def load(self, compiled_model_path, start_rank_id=None, local_ranks_size=None,
             skip_warmup=False):
        compiled_model_path = normalize_path(compiled_model_path)
        path = compiled_model_path + COMPILED_MODEL_FILE_NAME
        if not os.path.isfile(path):
            raise ValueError(f"The provided filename {path} does not exist")
        with open(path) as f:
            graphs = json.load(f)
        if graphs != self._graphs():
            raise RuntimeError(f"compiled graphs {graphs} differ from {self._graphs()}")
        self._check_fused_spec_model()
        text = self.config.get_text_config()
        draft = None
        if self.neuron_config.enable_fused_speculation:
            draft_config = self.fused_spec_config.draft_config
            draft = (draft_config.neuron_config, draft_config.get_text_config())
        self.traced_model = TracedModel(NxDModel(self.neuron_config, text, graphs, draft))
        self.load_weights(compiled_model_path)
        self.traced_model.nxd_model.garbled = set(getattr(self, "garbled", ())) | self._eagle_misfit()
        # NxD traced each submodel's module (model_cls(config)); the double runs those
        # whose class overrides forward (model_base.NeuronBaseModel)
        self.traced_model.nxd_model.traced_modules = {
            model.tag: model.model_cls(model.config) for model in self.models
            if model.model_cls is not None and "forward" in vars(model.model_cls)}
        self._load_lora_weights()
        for model_wrapper in self.models:
            model_wrapper.model = self.traced_model
        self.is_loaded_to_neuron = True
        if not self.neuron_config.skip_warmup and not skip_warmup:
            self.warmup()

    def _load_lora_weights(self):
        """The LoRA weights among the loaded device weights (one weight set for every
        submodel): each adapter slot's weight [max_loras] (lora_checkpoint.py
        update_weights_for_lora; with save_sharded_checkpoint as the compile sharded it,
        load_weights reads no adapter folder) and weight_active [batch_size], one row per
        sequence (lora_layer.py set_weight_shapes, max_loras_active = batch_size). With
        dynamic_multi_lora, load_weights ends with init_dynamic_multi_lora(..., 
        get_cte_model()), which is None on the pre-sharded path: no model builder was
        made (ef2731e lines 185-197, 402-419)."""
        lora = self.neuron_config.lora_config
        if lora is None:
            return
        from neuronx_distributed_inference.modules.lora_serving.lora_model import MODULE

        presharded = self.neuron_config.save_sharded_checkpoint
        for rank, rank_weights in enumerate(self.traced_model.nxd_model.weights):
            rank_weights[MODULE] = (self.loaded_weights[rank][MODULE].clone() if presharded
                                    else self.lora_model_manager.device_weights())
            rank_weights[MODULE + "_active"] = torch.zeros(lora.batch_size)
        if lora.dynamic_multi_lora:
            self.lora_model_manager.init_dynamic_multi_lora(
                None, None if presharded else self.context_encoding_model)

    def _check_fused_spec_model(self):
        """What NeuronFusedSpecModel.__init__ asserts, when compile and load build it."""
        if self.neuron_config.enable_fused_speculation:
            from neuronx_distributed_inference.models.model_base import NeuronFusedSpecModel

            NeuronFusedSpecModel.check(self.config)

    # An EAGLE draft's own tensors, loaded from its folder: the embedding and lm_head of
    # NxDI's Llama model and, under is_eagle_draft, the fc over [embedding; hidden state]
    # (modeling_llama.py NeuronLlamaModel.init_model, ef2731e lines 1155-1168).
    EAGLE_DRAFT_TENSORS = ("embed_tokens.weight", "lm_head.weight", "fc.weight")

    def _eagle_misfit(self):
        """{"draft_model."} when an EAGLE application's draft would not draft from the
        target's hidden states as EAGLE defines: its NeuronConfig is not is_eagle_draft
        (the model is then a plain decoder without fc, fed its embeddings alone:
        model_base.py NeuronBaseModel.get_model_output calls
        process_eagle_draft_hidden_states only under is_eagle_draft), or its folder
        lacks a tensor of EAGLE_DRAFT_TENSORS (NxDI loads the draft state dict
        non-strictly, leaving it as initialised). Its drafts are then wrong (the double's
        garbled peak) while the target still decides every token."""
        if not self.neuron_config.enable_eagle_speculation:
            return set()
        draft = self.fused_spec_config.draft_config.neuron_config
        names = set(self.loaded_weights[0])
        missing = [n for n in self.EAGLE_DRAFT_TENSORS if f"draft_model.{n}" not in names]
        return {"draft_model."} if missing or not draft.is_eagle_draft else set()

    def _trace(self, workdir):
        """ModelBuilder.trace's use of its work folder (neuronx-distributed 0.18
        trace/model_builder.py): it deletes the folder (lines 544-545), writes each
        submodel's buckets under `{workdir}/{tag}/_tp0_bk{i}` (the HLO and the NEFF the
        compiler returns, lines 717-760; here the graph's description), then
        build_nxd_model reads the NEFFs back from there into the traced model (lines
        1053-1060), and NxDI saves its configs beside them
        (_save_configs_to_compiler_workdir, application_base.py 267-290). What is read
        back is whatever the folder then holds. Test instrumentation, not NxD:
        FAKE_NXDI_TRACE_BARRIER="FOLDER:N" makes the trace wait, between writing and
        reading back, until N traces have written (a file each in FOLDER), so that
        concurrent compiles interleave there deterministically."""
        if os.path.exists(workdir):
            shutil.rmtree(workdir)
        for tag, entry in self._graphs().items():
            for rank, graph in enumerate(entry["graphs"]):
                folder = os.path.join(workdir, tag, f"_tp0_bk{rank}")
                os.makedirs(folder, exist_ok=True)
                with open(os.path.join(folder, "model.neff"), "w") as f:
                    json.dump({"output_logits": entry["output_logits"], "graph": graph}, f)
        _trace_barrier()
        graphs = {}
        for tag, entry in self._graphs().items():
            neffs = []
            for rank in range(len(entry["graphs"])):
                with open(os.path.join(workdir, tag, f"_tp0_bk{rank}", "model.neff")) as f:
                    neffs.append(json.load(f))
            graphs[tag] = {"output_logits": neffs[0]["output_logits"],
                           "graphs": [neff["graph"] for neff in neffs]}
        self.config.save(workdir)
        return graphs

    def _graphs(self):
        """tag -> its graphs' output_logits and [(bucket, shape key of its example
        inputs)], in the order of self.models, JSON-shaped."""
        return {model.tag: {"output_logits": bool(model.neuron_config.output_logits),
                            "graphs": [[bucket, shape_key(example)] for bucket, example in
                                       zip(model.neuron_config.buckets,
                                           model.input_generator())]}
                for model in self.models}

    def to_cpu(self):
        """application_base.to_cpu (ef2731e lines 556-628): with continuous batching one
        eager model per wrapper, built from the wrapper's config; otherwise one model
        from the application's config, shared by every wrapper; then eval()."""
        if self.neuron_config.speculation_length > 0:
            raise NotImplementedError("Speculation is not yet supported for CPU inference.")
        layers = self.config.get_text_config().num_hidden_layers
        if self.config.neuron_config.is_continuous_batching:
            for wrapper in self.models:
                wrapper.model = EagerModel(wrapper.config.neuron_config, layers)
        else:
            shared = EagerModel(self.neuron_config, layers)
            for wrapper in self.models:
                wrapper.model = shared
        # to_cpu ends with self.eval(): it reaches the wrappers' eager models through the
        # application's submodules (context_encoding_model, token_generation_model, ...),
        # not through the plain list self.models.
        self.eval()

    def warmup(self):
        for model in self.models:
            for example in model.input_generator():
                model.model.nxd_model.forward(list(example))
        nxd_model = self.traced_model.nxd_model
        for record in (nxd_model.ran, nxd_model.inputs, nxd_model.returned):
            record.clear()  # test instrumentation records the calls after loading

    def load_weights(self, compiled_model_path, start_rank_id=None, local_ranks_size=None):
        """The weights the device gets: the pre-sharded ones of the artifacts, or the
        checkpoint (checkpoint_loader_fn) cast as neuronx-distributed casts it to the
        traced parameters (cast_weights, see quantization.cast_to_parameters)."""
        from neuronx_distributed_inference.quantization import cast_to_parameters

        if self.neuron_config.save_sharded_checkpoint:
            self.loaded_weights = [load_file(os.path.join(
                compiled_model_path, f"weights/tp{rank}_sharded_checkpoint.safetensors"))
                for rank in range(self.neuron_config.tp_degree)]
        else:
            self.loaded_weights = [cast_to_parameters(self.checkpoint_loader_fn(), self)]

    def checkpoint_loader_fn(self, mmap: bool = False):
        """application_base.checkpoint_loader_fn (ef2731e lines 630-683): the weights come
        from quantized_checkpoints_path only when quantized (the target's; a fused draft's
        from its own folder, whatever the target's quantization); each state dict by
        get_state_dict; floating tensors but fp8 and scales cast to torch_dtype unless
        it is float32 (_cast_helper)."""
        model_path = getattr(self.config, "_name_or_path", None)
        if model_path is None or not os.path.exists(model_path):
            model_path = self.model_path
        if self.config.neuron_config.quantized:
            model_path = self.config.neuron_config.quantized_checkpoints_path
            if not os.path.exists(model_path):
                raise FileNotFoundError(f"Quantized checkpoint file not found: {model_path}")
        if self.config.neuron_config.enable_fused_speculation:
            spec = self.fused_spec_config
            weights = {f"draft_model.{name}": tensor for name, tensor in
                       self.get_state_dict(spec.draft_model_path, spec.draft_config).items()}
            weights.update({f"target_model.{name}": tensor for name, tensor in
                            self.get_state_dict(model_path, self.config).items()})
        else:
            weights = self.get_state_dict(model_path, self.config)
        dtype = self.neuron_config.torch_dtype
        if dtype != torch.float32 and getattr(self.neuron_config, "cast_type", "config") == "config":
            for name, tensor in list(weights.items()):
                if (torch.is_floating_point(tensor) and tensor.dtype != torch.float8_e4m3fn
                        and not name.endswith("scale")):
                    weights[name] = tensor.to(dtype)
        return weights

    @classmethod
    def get_state_dict(cls, model_path, config):
        """application_base.get_state_dict (ef2731e lines 692-738): a folder's state dict
        (NxDI's load_state_dict: safetensors, or .bin via torch.load; a file via
        torch.load: the double never unpickles and refuses both), `model.` prefixes
        dropped, `.weight_scale` renamed `.scale`, the model's
        convert_hf_to_neuron_state_dict, and with the config's
        tie_word_embeddings the model's update_state_dict_for_tied_weights (lm_head.weight
        replaced by a copy of embed_tokens.weight, whatever the checkpoint held)."""
        if os.path.isfile(model_path) or any(
                n.endswith((".bin", ".pt")) for n in os.listdir(model_path)):
            raise RuntimeError(f"the NxDI double does not unpickle checkpoints ({model_path})")
        weights = {}
        for name in sorted(os.listdir(model_path)):
            if name.endswith(".safetensors"):
                weights.update(load_file(os.path.join(model_path, name)))
        renamed = {}
        for name, tensor in weights.items():
            name = name.removeprefix("model.")
            renamed[name.replace(".weight_scale", ".scale")] = tensor
        renamed = cls.convert_hf_to_neuron_state_dict(renamed, config)
        if getattr(config, "tie_word_embeddings", False):
            cls.update_state_dict_for_tied_weights(renamed)
        return renamed

    @staticmethod
    def convert_hf_to_neuron_state_dict(state_dict, config):
        """application_base (ef2731e lines 741-744): the state dict unchanged; models
        override it."""
        return state_dict

    @staticmethod
    def update_state_dict_for_tied_weights(state_dict):
        raise NotImplementedError("State-dict update not implemented")

    @classmethod
    def save_quantized_state_dict(cls, model_path: str, config: InferenceConfig):
        """NxDI's own quantizer (see neuronx_distributed_inference/quantization.py)."""
        from neuronx_distributed_inference.quantization import save_quantized_state_dict

        save_quantized_state_dict(model_path, config.neuron_config)
