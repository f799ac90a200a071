"""The MLflow pyfunc model of a fine-tuned Stable Diffusion pipeline: prompts in, PNG images out.

This file is an MLflow "model from code" script: `log_diffusers_model` hands its path to mlflow, which copies it into
the model and runs it when the model is loaded (it ends with `mlflow.models.set_model`). Do not import it. It needs
only mlflow, diffusers, torch, pandas, numpy and pillow, not rangefinder, so anyone with MLflow can load the model.

Input: a pandas DataFrame (or a dict of its columns) with a `prompt` column and optional `seed` (an int from 0 to
MAX_SEED, as the run's seeds; default: the row number) and `negative_prompt` columns. Params (per call, defaults
from the model config): num_inference_steps, guidance_scale, height, width. The config holds the training run's
sampling settings: those four, the scheduler its samples used (`scheduler`, where sampling.scheduler named one) and,
for a model with T5, the max_sequence_length it was trained with; and the multiple of pixels its sides take
(`size_multiple`), which a call's height and width are checked against; and the dtype the model samples in by the
precision the machine offers (`sampling_dtypes`: bf16 for SD3 and Flux on a GPU that has it). Output: a DataFrame
with `prompt`, `seed` and `image`, a row per prompt, the image as a base64-encoded PNG (a string, so it survives
MLflow's JSON serving as well). Each image depends only on its own (prompt, seed), never on the other rows,
because each row gets its own seeded generator.
"""

import base64
import io

import mlflow
import numpy as np
import pandas as pd
from mlflow.exceptions import MlflowException
from mlflow.pyfunc import PythonModel

# The pipeline's call arguments the model config sets. max_sequence_length, in the config of a model with T5 only (SD3,
# Flux), is the T5 length the model was trained with, which the registration wrote there
# (training/family_detection.py: t5_sequence_length), not its pipeline's default (StableDiffusion3Pipeline's 256 where
# SD3 trains with 77 tokens); it is no param, as another length is another conditioning than the one trained.
CALL_SETTINGS = ("num_inference_steps", "guidance_scale", "height", "width", "max_sequence_length")
# The most a call's height or width may be, in multiples of the model's default side (the size its run sampled at).
# Memory and time grow with the pixels, attention's faster: a height of 100000 was drawn until the kernel killed the
# process (a serving container with it), with no word; 4 x is well past the size a model draws whole pictures at.
MAX_SIDE_FACTOR = 4
# The seeds rangefinder's config and grid take (rangefinder.config.MAX_SEED, which this file may not import): a
# torch.Generator takes a negative one too, and drew an image of a seed no grid or config can name.
MAX_SEED = 2**32 - 1


class StableDiffusionPyfunc(PythonModel):
    def load_context(self, context):
        import diffusers
        import torch
        from diffusers import DiffusionPipeline

        self.defaults = dict(context.model_config or {})
        self.device = "cuda" if torch.cuda.is_available() else "cpu"
        self.pipe = DiffusionPipeline.from_pretrained(context.artifacts["pipeline"], dtype=self.dtype())
        # The scheduler the training run's samples were drawn with (sampling.scheduler, e.g. the demo's DDIM, where a
        # saved SD 1.x folder keeps the training DDPM), set up from the saved one's config as rangefinder's grid does,
        # so it predicts what the weights were trained to. None in the config: the folder's own.
        scheduler = self.defaults.get("scheduler")
        if scheduler and scheduler != type(self.pipe.scheduler).__name__:
            self.pipe.scheduler = getattr(diffusers, scheduler).from_config(self.pipe.scheduler.config)
        self.pipe.to(self.device)
        self.pipe.set_progress_bar_config(disable=True)
        # FLUX.1-schnell's transformer has no guidance embedding (its config's guidance_embeds is false), and
        # FluxPipeline feeds it no scale: a call's scale would change nothing.
        transformer = getattr(self.pipe, "transformer", None)
        self.guidance_input = not (type(self.pipe).__name__ == "FluxPipeline" and transformer is not None
                                   and not transformer.config.get("guidance_embeds", False))

    def dtype(self):
        """The dtype the model samples in on this machine: the config's `sampling_dtypes` (written by the registration
        from rangefinder's family_detection.sampling_dtypes: bf16 for SD3 and Flux, whose T5 overflows in fp16) for
        the precision this device offers, as rangefinder's config.resolve_mixed_precision tells it. A model
        registered without them: fp16 on a GPU, fp32 on a CPU."""
        import torch

        if self.device != "cuda":
            precision = "no"
        else:
            precision = "bf16" if torch.cuda.is_bf16_supported(including_emulation=False) else "fp16"
        name = dict(self.defaults.get("sampling_dtypes") or {}).get(precision)
        return getattr(torch, name) if name else (torch.float16 if self.device == "cuda" else torch.float32)

    # The DataFrame hint tells mlflow to validate against the logged signature rather than infer one from the hint.
    def predict(self, context, model_input: pd.DataFrame, params: dict | None = None) -> pd.DataFrame:
        import torch

        df = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame({"prompt": list(model_input)})
        settings = {**self.defaults, **{k: v for k, v in (params or {}).items() if v is not None}}
        call = {k: settings[k] for k in CALL_SETTINGS if settings.get(k) is not None}
        if not self.guidance_input:
            self.check_no_guidance_asked((params or {}).get("guidance_scale"))
            call.pop("guidance_scale", None)
        self.check_call(call)
        records = one_row_per_prompt(df)
        # A gap pandas leaves in the column (None, NaN) was drawn as the prompt "None" or "nan"; '' is a prompt (none).
        gaps = [i for i, r in enumerate(records) if r.get("prompt") != "" and missing(r.get("prompt"))]
        if gaps:
            raise MlflowException.invalid_parameter_value(
                f"prompt: row(s) {', '.join(map(str, gaps[:10]))} have none (None or NaN), which would be drawn as the "
                "text 'None' or 'nan'; give each row its prompt ('' draws without one)")
        negatives = [None if missing(r.get("negative_prompt")) else str(r["negative_prompt"]) for r in records]
        if any(negatives):
            self.check_negative_prompt_steers(float(call.get("guidance_scale", 1.0)))
        seeds = [i if missing(r.get("seed")) else int(r["seed"]) for i, r in enumerate(records)]
        outside = [(i, s) for i, s in enumerate(seeds) if not 0 <= s <= MAX_SEED]
        if outside:
            raise MlflowException.invalid_parameter_value(
                f"seed: row(s) {', '.join(f'{i} ({s})' for i, s in outside[:10])} have a seed the run's grid and "
                f"config refuse; pass seeds from 0 to {MAX_SEED}")
        rows = []
        for row, negative, seed in zip(records, negatives, seeds, strict=True):
            # On the CPU, as the grid's (sampling.render_grid): a seed draws the same initial noise on any device.
            generator = torch.Generator("cpu").manual_seed(seed)
            image = self.pipe(
                prompt=str(row["prompt"]),
                negative_prompt=negative,
                generator=generator,
                **call,
            ).images[0]
            buf = io.BytesIO()
            image.save(buf, format="PNG")
            rows.append({"prompt": str(row["prompt"]), "seed": seed,
                         "image": base64.b64encode(buf.getvalue()).decode("ascii")})
        return pd.DataFrame(rows, columns=["prompt", "seed", "image"])

    def check_call(self, call: dict) -> None:
        """Refuse steps below 1 (the pipeline divides by zero, or draws an image of none), a height or width off
        the sides the pipeline renders, the model config's size_multiple (SD3's refuses them in its own words,
        Flux's quietly renders a smaller image, and a side of 0 draws at the pipeline's default size), one over
        MAX_SIDE_FACTOR times the model's default, and a guidance scale below 0."""
        steps = call.get("num_inference_steps")
        if steps is not None and int(steps) < 1:
            raise MlflowException.invalid_parameter_value(
                f"num_inference_steps: {steps} draws no image; pass 1 or more")
        guidance = call.get("guidance_scale")
        if guidance is not None and not float(guidance) >= 0:  # NaN too
            # Drawn as if it were 1 (no classifier-free guidance runs at 1 or below); rangefinder's grid and the
            # config refuse it alike.
            raise MlflowException.invalid_parameter_value(
                f"guidance_scale: {guidance} is below 0; pass 0 or more (the default is "
                f"{self.defaults.get('guidance_scale')})")
        multiple = int(self.defaults.get("size_multiple") or 1)
        for side in ("height", "width"):
            value = call.get(side)
            if value is not None and (int(value) < multiple or int(value) % multiple):
                raise MlflowException.invalid_parameter_value(
                    f"{side}: the pipeline renders sides in multiples of {multiple} px, not {value}; pass a multiple "
                    f"of {multiple} (the default is {self.defaults.get(side)})")
            default = self.defaults.get(side)
            if value is not None and default and int(value) > MAX_SIDE_FACTOR * int(default):
                raise MlflowException.invalid_parameter_value(
                    f"{side}: {value} px is over {MAX_SIDE_FACTOR} times the model's {default} px, more memory and "
                    f"time than a picture of it takes; pass at most {MAX_SIDE_FACTOR * int(default)}")

    def check_no_guidance_asked(self, guidance_scale) -> None:
        """Refuse a guidance scale for a model without the guidance input, as rangefinder's grid does: 0 (diffusers'
        own schnell example passes it) and the model config's default ask for none."""
        if guidance_scale and guidance_scale != self.defaults.get("guidance_scale"):
            raise MlflowException.invalid_parameter_value(
                f"guidance_scale: {guidance_scale} changes nothing: this model has no guidance embedding (its "
                "transformer's guidance_embeds is false, as FLUX.1-schnell's), so its pipeline ignores every "
                "guidance scale; leave guidance_scale out")

    def check_negative_prompt_steers(self, guidance_scale: float) -> None:
        """Refuse a negative prompt the pipeline would draw without: FluxPipeline's guidance_scale is Flux.1-dev's
        distilled guidance input, and it reads a negative prompt only with true_cfg_scale, which this model does
        not set; the other pipelines read one for classifier-free guidance, which they run above guidance_scale 1."""
        if type(self.pipe).__name__ == "FluxPipeline":
            raise MlflowException.invalid_parameter_value(
                "negative_prompt: a Flux model draws without one (its guidance_scale is Flux.1-dev's distilled "
                "guidance, not classifier-free guidance, which a negative prompt steers); leave the column out")
        if guidance_scale <= 1:
            raise MlflowException.invalid_parameter_value(
                f"negative_prompt: this call's guidance_scale is {guidance_scale:g}, and classifier-free guidance, "
                "which a negative prompt steers, runs only above 1; pass params={'guidance_scale': ...} above 1, or "
                "leave the column out")


def missing(value) -> bool:
    """A cell the input leaves empty: absent, None or NaN (pandas fills a column's gaps with them), or ''."""
    return value is None or (not isinstance(value, str) and bool(pd.isna(value))) or value == ""


def one_row_per_prompt(df: pd.DataFrame) -> list[dict]:
    """The input's rows, one per prompt. MLflow makes a dict whose values are strings or lists of strings
    (`{"prompt": ["a cat", "a dog"]}`, a DataFrame's columns as a dict) into one row holding the lists, which would
    render a single image of the prompt "['a cat', 'a dog']"; such a row becomes a row per prompt, as pandas makes
    of that dict, a single value (a negative prompt, a seed) going with each prompt."""
    rows = []
    for row in df.to_dict("records"):
        if not isinstance(row.get("prompt"), (list, tuple, np.ndarray)):
            rows.append(row)
            continue
        try:
            rows.extend(pd.DataFrame(row).to_dict("records"))
        except ValueError:
            lengths = ", ".join(f"{k} {len(v)}" for k, v in row.items() if isinstance(v, (list, tuple, np.ndarray)))
            raise MlflowException.invalid_parameter_value(
                f"the input's columns are lists of different lengths ({lengths}); give each column one value per "
                "prompt, or one value for every prompt") from None
    return rows


mlflow.models.set_model(StableDiffusionPyfunc())
