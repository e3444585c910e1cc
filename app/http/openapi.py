"""The service's OpenAPI description (``GET /openapi.json``, and ``/docs`` reads it): every
route's params, bodies, answers and headers as the service sends them.

Generated, not copied: the query params each route documents are the ones the protocol accepts
(``app.protocol.params.DECODE_PARAMS`` / ``ENCODE_PARAMS``), their enums the protocol's own
tables (``WIRE_DTYPES``, ``OUTPUT_TYPES``, ``IMAGE_FORMATS``), the body media types the parsers'
(``app.protocol.bodies``, ``app.protocol.encode``), the answers' media types and ``x-output``
labels the writers' (``app.protocol.output``, ``Output``, ``LatentFormat``, ``WIRE_NAME``), the
model name the store's ``NAME_RE``. What only exists as prose or as a literal inside a parser
(a param's meaning, its bounds, the JSON answers' shapes) is written here once, in ``PARAMS``,
``SCHEMAS`` and ``OPERATIONS``: a param the protocol accepts with no entry in ``PARAMS``, or a
route in the schema with no entry in ``OPERATIONS``, stops the description from being built
(an error naming it), and tests/test_openapi.py checks the bounds against ``parse_params`` and
every answer of a live server against the description (schemathesis).

``install_openapi(app)`` keeps FastAPI's generator for what it knows (the info, each route's
summary and operation id) and replaces each operation's params, body and answers with these.
"""

from __future__ import annotations

import copy
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute

from app.http.envelope import REQUEST_ID_RE
from app.http.streams import TENSOR_LAYOUTS
from app.media.write import WIRE_NAME
from app.protocol.bodies import NPY_TYPE, RAW_TYPES, SAFETENSORS_TYPE
from app.protocol.encode import IMAGE_TYPES, MP4_TYPES
from app.protocol.output import IMAGE_MIME, MP4_MIME, TENSOR_MIME
from app.protocol.params import (
    DECODE_PARAMS,
    ENCODE_PARAMS,
    IMAGE_FORMATS,
    MAX_DIM,
    OUTPUT_TYPES,
    WIRE_DTYPES,
)
from app.protocol.request import LatentFormat, Output
from app.store import NAME_RE

REF = "#/components/schemas/"
BINARY = {"type": "string", "format": "binary"}
BOOLEAN = {"type": "boolean"}
BOOLEANS = "true/false, 1/0, yes/no in any case (Python's True/False too)"
# image_format also takes "jpeg" (read as jpg), in any case
IMAGE_FORMAT_NAMES = [*IMAGE_FORMATS, "jpeg"]
# what a decode's x-output header says: the image format, else the output kind
OUTPUT_LABELS = [*IMAGE_FORMATS, *(o.value for o in Output if o is not Output.IMAGE)]
ENCODE_OUTPUT_LABEL = "latent"  # app/http/encode.py's OUTPUT_LABEL
ENCODE_LABEL = {
    "x-output": {
        "description": "always `latent` (the encode's metrics label)",
        "schema": {"type": "string", "enum": [ENCODE_OUTPUT_LABEL]},
    }
}

# --- query params: every name the protocol accepts, with its schema and meaning per route ----
# Bounds are parse_params' own (tests/test_openapi.py checks each against it); a value inside
# them can still be refused later (a shape the model cannot take, a factor that is 0 in float32).
PARAMS: dict[str, dict[str, Any]] = {
    "shape": {
        "schema": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": MAX_DIM},
            "minItems": 2,
            "maxItems": 5,
        },
        "decode": "the latent's shape, for a raw body (tensor/binary, application/octet-stream): "
        "repeated keys (`shape=1&shape=16&shape=64&shape=64`, as remote_decode sends it), or one "
        "value holding a JSON list (`[1,16,64,64]`) or `1,16,64,64`",
        "encode": "the pixels' shape, for a raw body: `[B,3,H,W]`, or `[B,3,T,H,W]` for a video "
        "model; repeated keys, a JSON list or comma-separated",
    },
    "dtype": {
        "schema": {"type": "string", "enum": list(WIRE_DTYPES)},
        "decode": "a raw body's dtype (exactly as written; default float32)",
        "encode": "a raw body's dtype (exactly as written; default float32)",
    },
    "output_type": {
        "schema": {"type": "string", "enum": list(OUTPUT_TYPES)},
        "decode": "what to answer (any case): `pil` an image (or, with `Accept: tensor/binary` or "
        "for a video model, `[N,3,H,W]` floats in [0,1]); `pt` the decoder's own output; `mp4` a "
        "streamed H.264 MP4 (video models); `preview` an image from the latent-to-RGB map, no "
        "decoder (batch 1). Default: pil, or what `Accept` asks for",
    },
    "image_format": {
        "schema": {"type": "string", "enum": IMAGE_FORMAT_NAMES},
        "decode": "the image's format, any case (`jpeg` = `jpg`); else the `Accept` image type, "
        "else png",
    },
    "partial_postprocess": {
        "schema": BOOLEAN,
        "decode": f"with output_type=pt: uint8 `[B,H,W,3]` (video: `[T,H,W,3]`). {BOOLEANS}",
    },
    "scaling_factor": {
        "schema": {"type": "number"},
        "decode": "applied as `z / scaling_factor + shift_factor`; must be non-zero and finite, "
        "and so must its inverse, in float32",
        "encode": "applied as `(z - shift_factor) * scaling_factor` (remote_encode's semantics)",
    },
    "shift_factor": {
        "schema": {"type": "number"},
        "decode": "added after scaling (|shift_factor| < 3.4e38)",
        "encode": "subtracted before scaling",
    },
    "do_scaling": {
        "schema": BOOLEAN,
        "decode": f"without factors: the model's own de-normalization. {BOOLEANS}",
        "encode": f"without factors: the model's own normalisation. {BOOLEANS}",
    },
    "height": {
        "schema": {"type": "integer", "minimum": 1},
        "decode": "pixel height, for a FLUX packed latent `[B,(h/2)(w/2),4C]`",
    },
    "width": {
        "schema": {"type": "integer", "minimum": 1},
        "decode": "pixel width, for a FLUX packed latent",
    },
    "input_tensor_type": {
        "schema": {"type": "string"},
        "deprecated": True,
        "decode": "sent by older remote_decode releases: accepted and ignored",
    },
    "output_tensor_type": {
        "schema": {"type": "string"},
        "deprecated": True,
        "decode": "sent by older remote_decode releases: accepted and ignored",
    },
    "return_type": {
        "schema": {"type": "string"},
        "deprecated": True,
        "decode": "sent by older remote_decode releases: accepted and ignored",
    },
    "fps": {
        "schema": {"type": "number", "minimum": 0.1, "maximum": 240},
        "decode": "the MP4's frame rate (default: the model's, else 24)",
    },
    "timestep": {
        "schema": {"type": "number", "minimum": 0, "maximum": 1000},
        "decode": "decode timestep (timestep-conditioned LTX decoders)",
    },
    "seed": {
        "schema": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
        "decode": "noise seed (LTX noise injection)",
        "encode": "the sample's noise seed (default 0); only with sample=true, else 422",
    },
    "quality": {
        "schema": {"type": "integer", "minimum": 1, "maximum": 100},
        "decode": "JPEG / WebP quality (default 90)",
    },
    "model": {
        "schema": {"type": "string"},
        "decode": "the model to decode with (else VAE_DEFAULT_MODEL, else the only one served); "
        "ignored on /decode/{model}, where the path names it",
        "encode": "the model to encode with (else VAE_DEFAULT_MODEL, else the only one served); "
        "ignored on /encode/{model}, where the path names it",
    },
    "timeout": {
        "schema": {"type": "number", "exclusiveMinimum": 0},
        "decode": "seconds this request may wait for its decode to start (capped by "
        "VAE_MAX_REQUEST_TIMEOUT_S; the X-Request-Timeout header wins)",
        "encode": "seconds this request may wait for its encode to start (capped by "
        "VAE_MAX_REQUEST_TIMEOUT_S; the X-Request-Timeout header wins)",
    },
    "frame": {
        "schema": {"type": "integer", "minimum": -MAX_DIM, "maximum": MAX_DIM},
        "decode": "with output_type=preview and a 5-D latent only: the latent frame previewed "
        "(default 0; negative counts from the end)",
    },
    "sample": {
        "schema": BOOLEAN,
        "encode": f"a seeded sample `mean + std * noise` instead of the mean. {BOOLEANS}",
    },
    "packed": {
        "schema": BOOLEAN,
        "encode": f"FLUX's packed latent `[B,(h/2)(w/2),4C]` (flux family only). {BOOLEANS}",
    },
}

TIMEOUT_HEADER = {
    "name": "X-Request-Timeout",
    "in": "header",
    "required": False,
    "schema": {"type": "number", "exclusiveMinimum": 0},
    "description": "seconds this request may wait for its run to start; wins over `timeout`, "
    "capped by the server",
}
LAYOUT_HEADER = {
    "name": "X-Tensor-Layout",
    "in": "header",
    "required": False,
    "schema": {"type": "string", "enum": list(TENSOR_LAYOUTS)},
    "description": "the layout of a video's output_type=pt answer (any case): the decoder's "
    f"own `{TENSOR_LAYOUTS[0]}` (default) or `{TENSOR_LAYOUTS[1]}`, frame by frame",
}


MODEL_PATH_PARAM = {
    "name": "model",
    "in": "path",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{NAME_RE.pattern}$"},
    "description": "a store entry's name (GET /models); an unknown or invalid one is a 404",
}


def query_params(accepted: frozenset[str], route: str) -> list[dict[str, Any]]:
    """The query params of a route that accepts ``accepted``, in ``PARAMS``' order; a name with
    no entry (or none for this route) is an error: the description would lie by omission."""
    undocumented = sorted(n for n in accepted if route not in PARAMS.get(n, {}))
    if undocumented:
        raise RuntimeError(
            f"the {route} route accepts {', '.join(undocumented)}, which app/http/openapi.py "
            "does not describe (PARAMS)"
        )
    out = []
    for name, entry in PARAMS.items():
        if name not in accepted:
            continue
        param = {"name": name, "in": "query", "required": False, "schema": entry["schema"]}
        param["description"] = entry[route]
        if entry["schema"].get("type") == "array":
            param["style"], param["explode"] = "form", True
        if entry.get("deprecated"):
            param["deprecated"] = True
        out.append(param)
    return out


# --- request bodies, from the parsers' own media types --------------------------------------

DECODE_BODY_TYPES = [*sorted(RAW_TYPES, key=lambda t: t != "tensor/binary"), SAFETENSORS_TYPE]
DECODE_BODY_TYPES.append(NPY_TYPE)
ENCODE_BODY_TYPES = [*IMAGE_TYPES, *sorted(MP4_TYPES), *DECODE_BODY_TYPES]


def request_body(kinds: list[str], description: str) -> dict[str, Any]:
    return {
        "required": True,
        "description": description,
        "content": {kind: {"schema": BINARY} for kind in kinds},
    }


DECODE_BODY = request_body(
    DECODE_BODY_TYPES,
    "The latent: raw little-endian tensor bytes in C order (with the `shape` and `dtype` "
    "params; no Content-Type reads as tensor/binary), a safetensors file holding one tensor, "
    "or a `.npy` file (read from its header, never with pickle). Layouts: `[C,H,W]`, "
    "`[B,C,H,W]`, video `[B,C,T,H,W]`, FLUX packed `[B,(h/2)(w/2),4C]` with `height`/`width`.",
)
ENCODE_BODY = request_body(
    ENCODE_BODY_TYPES,
    "An image (PNG, JPEG, WebP; with no Content-Type, a body starting with an image's magic "
    "bytes, as remote_encode sends a PIL image), RGB pixels in [-1, 1] as raw little-endian "
    "bytes (with `shape` and `dtype`; no Content-Type with `shape` reads as raw), a "
    "safetensors file (one tensor) or a `.npy` file, or an MP4 (video models only, else 415).",
)

# --- answers --------------------------------------------------------------------------------

EVERY_ANSWER_HEADERS = {
    "X-Request-Id": {
        "required": True,
        "description": "the request's id (in its log line too): the caller's X-Request-Id "
        "when it matches this pattern, else a new one",
        "schema": {"type": "string", "pattern": f"^{REQUEST_ID_RE.pattern}$"},
    },
    "Server-Timing": {
        "required": True,
        "description": "the request's phases and `total`, in milliseconds (docs/metrics.md)",
        "schema": {"type": "string"},
    },
}
RETRY_AFTER = {
    "Retry-After": {
        "required": True,
        "description": "seconds to wait before retrying (VAE_RETRY_AFTER_S)",
        "schema": {"type": "integer", "minimum": 0},
    }
}
WWW_AUTHENTICATE = {
    "WWW-Authenticate": {
        "required": True,
        "description": 'RFC 6750: `Bearer realm="vae"`, with `error="invalid_token"` when a '
        "token came and matched none",
        "schema": {"type": "string", "pattern": "^Bearer "},
    }
}
TENSOR_HEADERS = {
    "shape": {
        "description": "the tensor's shape, a JSON list",
        "schema": {"type": "string", "pattern": r"^\[[0-9, ]*\]$"},
    },
    "dtype": {
        "description": "the tensor's dtype",
        "schema": {"type": "string", "enum": list(dict.fromkeys(WIRE_NAME.values()))},
    },
}


def answer(
    description: str,
    content: dict[str, Any] | None = None,
    headers: dict[str, Any] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"description": description}
    if content:
        out["content"] = content
    out["headers"] = {**EVERY_ANSWER_HEADERS, **(headers or {})}
    return out


def json_body(schema: dict[str, Any]) -> dict[str, Any]:
    return {"application/json": {"schema": schema}}


def ref(name: str) -> dict[str, str]:
    return {"$ref": REF + name}


def error(description: str, schema: str = "Error", retry: bool = False, **headers: Any) -> dict:
    extra = {**(RETRY_AFTER if retry else {}), **headers}
    return answer(description, json_body(ref(schema)), extra)


FRAMED_TWICE = (
    "both Content-Length and Transfer-Encoding (RFC 9112 6.3): refused, connection closed"
)
SERVER_ERROR = error(
    "a bug: every unhandled exception is answered with this JSON and logged with the request id",
    "ServerError",
)
UNAUTHORIZED = error(
    "VAE_API_TOKENS is set and no `Authorization: Bearer` token, or an unknown one, came",
    **WWW_AUTHENTICATE,
)


def run_errors(op: str, named: bool) -> dict[str, Any]:
    """The refusals of a decode or encode request (``op``), as app/http/handling.py answers."""
    part = "decoder" if op == "decode" else "encoder"
    no_model = (
        ""
        if named
        else "; no model named (no ?model=, no VAE_DEFAULT_MODEL, more than one model served)"
    )
    not_found = "no such model, or an invalid model name"
    if op == "encode":
        not_found += "; a decoder-only entry (no encoder), or VAE_SERVE_ENCODERS=false"
    answers = {
        "400": error(
            "a body that is not what it says (bytes that do not match `shape` and `dtype`, an "
            "invalid safetensors / .npy / image / MP4 file, an empty body)"
            f"{no_model}; or {FRAMED_TWICE}"
        ),
        "401": UNAUTHORIZED,
        "404": error(not_found),
        "408": error("the body did not arrive within VAE_BODY_TIMEOUT_S (connection closed)"),
        "413": error(
            "over a limit: the body (VAE_MAX_BODY_MB, VAE_BODIES_MB), the batch, pixels or "
            f"frames (VAE_MAX_BATCH, VAE_MAX_PIXELS, VAE_MAX_FRAMES), the {part}'s working "
            "memory (VAE_MAX_DECODE_MB, or more than the instance's memory could ever hold for "
            "one run), the answer (VAE_MAX_OUTPUT_MB)"
        ),
        "415": error(
            "a Content-Type the route does not read, a compressed body (Content-Encoding), or "
            "(encode) an MP4 for an image model"
        ),
        "422": answer(
            "a param, shape, dtype or value the model cannot take (`{error, expected}`: the "
            "protocol's refusals, naming the param); FastAPI's own validation of the path, "
            'rewritten as `{error: "invalid request", detail}`, has nothing to refuse today '
            "(`model` is any string)",
            json_body({"anyOf": [ref("Error"), ref("InvalidRequest")]}),
        ),
        "429": error(
            "the queue is full, the streamed-answers cap (VAE_STREAMS_MAX) is reached, or the "
            "what requests hold (bodies arriving, the latents and pixels parsed from them, "
            "answers not yet sent) fills its budget (VAE_BODIES_MB)",
            retry=True,
        ),
        "500": SERVER_ERROR,
        "503": error(
            f"the {op} could not start within the request's deadline, the model (or its "
            f"{part}) is still loading or failed to load, the {part} failed or ran out of "
            "memory, the device was lost, or the service is shutting down",
            retry=True,
        ),
    }
    if op == "encode":  # handled() labels every encode answer, refusals too (not auth's 401)
        for code, refusal in answers.items():
            if code != "401":
                answers[code] = {**refusal, "headers": {**refusal["headers"], **ENCODE_LABEL}}
    return answers


DECODE_OK = answer(
    "The decode. An image (output_type=pil for an image model, or output_type=preview: "
    "`image_format`, else the Accept image type, else PNG); a tensor (`tensor/binary`, raw "
    "little-endian bytes with the `shape` and `dtype` headers: output_type=pt, "
    "partial_postprocess's uint8 frames, or `[N,3,H,W]` in [0,1] for output_type=pil with "
    "`Accept: tensor/binary` or a video model); or a fragmented H.264 MP4. A video's answers "
    "(the MP4, its frames as a tensor) are streamed while the frames decode: their headers "
    "leave with the first frame, and a refusal after that can only cut the body short.",
    {
        **{mime: {"schema": BINARY} for mime in IMAGE_MIME.values()},
        MP4_MIME: {"schema": BINARY},
        TENSOR_MIME: {"schema": BINARY},
    },
    {
        **TENSOR_HEADERS,
        "x-model": {
            "required": True,
            "description": "the model that answered",
            "schema": {"type": "string"},
        },
        "x-output": {
            "required": True,
            "description": "what the body holds: the image format, else the output kind",
            "schema": {"type": "string", "enum": OUTPUT_LABELS},
        },
        "x-frames": {
            "description": "a video's answer (streamed: an MP4, or its frames as a tensor): the "
            "frames the whole body holds, every row's together",
            "schema": {"type": "integer", "minimum": 1},
        },
        "x-tensor-layout": {
            "description": "a video's output_type=pt answer: the layout of its bytes "
            "(X-Tensor-Layout)",
            "schema": {"type": "string", "enum": list(TENSOR_LAYOUTS)},
        },
    },
)
ENCODE_OK = answer(
    "The latent, float32, after the scaling asked for: raw little-endian bytes "
    "(`tensor/binary`, what remote_encode reads), or with `Accept: application/x-safetensors` "
    "a safetensors file holding `latent`, or with `Accept: application/x-npy` a `.npy` file.",
    {f.value: {"schema": BINARY} for f in LatentFormat},
    {
        **{k: {**v, "required": True} for k, v in TENSOR_HEADERS.items()},
        "dtype": {
            "required": True,
            "description": "the latent's dtype",
            "schema": {"type": "string", "enum": ["float32"]},
        },
        "x-model": {
            "required": True,
            "description": "the model that answered",
            "schema": {"type": "string"},
        },
        "x-output": {**ENCODE_LABEL["x-output"], "required": True},
    },
)

DECODE_TEXT = (
    "diffusers' `remote_decode` wire format (docs/wire-format.md). The `Accept` header may "
    "choose the answer when output_type is not given: `image/png`, `image/jpeg`, `image/webp`, "
    "`video/mp4` (video models), `tensor/binary`; an explicit output_type wins. "
    "A param the protocol does not name is refused with 422 naming it."
)
ENCODE_TEXT = (
    "diffusers' `remote_encode` wire format (docs/wire-format.md#encode-post-encode). Images and "
    "MP4 frames are preprocessed as diffusers' VaeImageProcessor (RGB, sizes rounded down to a "
    "multiple of the encoder's scale, to [-1, 1]). `Accept` picks the latent's format. A param "
    "the protocol does not name is refused with 422 naming it."
)


def run_operation(op: str, named: bool) -> dict[str, Any]:
    accepted = DECODE_PARAMS if op == "decode" else ENCODE_PARAMS
    params = [MODEL_PATH_PARAM] if named else []
    return {
        "description": DECODE_TEXT if op == "decode" else ENCODE_TEXT,
        "parameters": [
            *params,
            *query_params(accepted, op),
            TIMEOUT_HEADER,
            *([LAYOUT_HEADER] if op == "decode" else []),
        ],
        "requestBody": copy.deepcopy(DECODE_BODY if op == "decode" else ENCODE_BODY),
        "responses": {
            "200": DECODE_OK if op == "decode" else ENCODE_OK,
            **run_errors(op, named),
        },
    }


FRAMING = {"400": error(FRAMED_TWICE)}
OPEN = {"security": []}  # answered whether or not VAE_API_TOKENS is set

OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/healthz"): {
        **OPEN,
        "description": "200 while the process runs (HEAD too).",
        "responses": {
            "200": answer("alive", json_body(ref("Health"))),
            **FRAMING,
            "500": SERVER_ERROR,
        },
    },
    ("get", "/readyz"): {
        **OPEN,
        "description": "200 once every model is resident and gated (HEAD too); 503 before "
        "that, while draining, or after a failure, with the reason.",
        "responses": {
            "200": answer(
                "ready",
                json_body(
                    {"allOf": [ref("Readiness"), {"properties": {"ready": {"const": True}}}]}
                ),
            ),
            **FRAMING,
            "500": SERVER_ERROR,
            "503": answer(
                "not ready (no Retry-After: a probe polls)",
                json_body(
                    {
                        "allOf": [
                            ref("Readiness"),
                            {"required": ["reason"], "properties": {"ready": {"const": False}}},
                        ]
                    }
                ),
            ),
        },
    },
    ("get", "/models"): {
        "description": "Each loaded model: family, config summary, device, dtype, path, "
        "parity, fallback, mode, candidates, state; its encoder (null: decoder-only).",
        "responses": {
            "200": answer("the models", json_body(ref("Models"))),
            **FRAMING,
            "401": UNAUTHORIZED,
            "500": SERVER_ERROR,
        },
    },
    ("get", "/metrics"): {
        "description": "Prometheus text exposition. Open when VAE_API_TOKENS is set, unless "
        "VAE_PROTECT_METRICS is.",
        "responses": {
            "200": answer(
                "the metrics", {"text/plain": {"schema": {"type": "string"}}}
            ),  # text/plain; version=0.0.4
            **FRAMING,
            "401": error(
                "VAE_PROTECT_METRICS and VAE_API_TOKENS are set and no known bearer token came",
                **WWW_AUTHENTICATE,
            ),
            "500": SERVER_ERROR,
        },
    },
    ("post", "/decode/{model}"): run_operation("decode", named=True),
    ("post", "/decode"): run_operation("decode", named=False),
    ("post", "/encode/{model}"): run_operation("encode", named=True),
    ("post", "/encode"): run_operation("encode", named=False),
}
# routes FastAPI leaves out of its schema (include_in_schema=False) that are documented here
# all the same, when the app serves them: the page for people (app/http/page.py)
HIDDEN_OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("get", "/"): {
        **OPEN,
        "summary": "The page for people: the models, and try-it forms",
        "operationId": "page",
        "description": "Static HTML (its script, stylesheet and icon under /page/), open when "
        "VAE_API_TOKENS is set; the calls it makes carry the token typed into it.",
        "responses": {
            "200": answer("the page", {"text/html": {"schema": {"type": "string"}}}),
            **FRAMING,
            "500": SERVER_ERROR,
        },
    },
}

# --- the JSON answers' schemas ---------------------------------------------------------------

SECONDS = {"type": "object", "additionalProperties": {"type": "number"}}
SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "description": "Every refusal: what was wrong, and (when it can say) what was expected.",
        "required": ["error"],
        "properties": {
            "error": {"type": "string"},
            "expected": {"type": "string"},
        },
        "additionalProperties": False,
    },
    "InvalidRequest": {
        "type": "object",
        "description": "FastAPI's own validation of a path or query param, rewritten: its "
        "first 8 errors, each client value repr'd and clipped.",
        "required": ["error", "detail"],
        "properties": {
            "error": {"const": "invalid request"},
            "detail": {
                "type": "array",
                "maxItems": 8,
                "items": {
                    "type": "object",
                    "required": ["type", "loc", "msg"],
                    "properties": {
                        "type": {"type": "string"},
                        "loc": {"type": "array", "items": {"type": ["string", "integer"]}},
                        "msg": {"type": "string"},
                        "input": {"type": "string"},
                    },
                },
            },
        },
        "additionalProperties": False,
    },
    "ServerError": {
        "type": "object",
        "required": ["error"],
        "properties": {
            "error": {"const": "internal server error"},
            "request_id": {"type": "string", "description": "when the envelope answered it"},
        },
        "additionalProperties": False,
    },
    "Health": {
        "type": "object",
        "required": ["status"],
        "properties": {"status": {"const": "ok"}},
        "additionalProperties": False,
    },
    "ModelState": {
        "type": "object",
        "description": "Where one model's start is, with the seconds since its load began at "
        "which each state was entered and the seconds of each load phase.",
        "required": ["state", "state_seconds", "phase_seconds", "selection"],
        "properties": {
            "state": {"type": "string", "enum": ["loading", "gating", "ready", "failed"]},
            "state_seconds": SECONDS,
            "phase_seconds": SECONDS,
            "selection": {"type": ["string", "null"]},
            "error": {"type": "string"},
        },
    },
    "Readiness": {
        "type": "object",
        "description": "models, errors and states: where VAE_API_TOKENS is set, to a caller "
        "with a token only (a probe needs none; the others get details instead)",
        "required": ["ready"],
        "properties": {
            "ready": {"type": "boolean"},
            "models": {"type": "array", "items": {"type": "string"}},
            "errors": {"type": "object", "additionalProperties": {"type": "string"}},
            "states": {"type": "object", "additionalProperties": ref("ModelState")},
            "reason": {"type": "string", "description": "why not ready (503 only)"},
            "details": {"type": "string", "description": "how to get the rest"},
        },
        "additionalProperties": False,
    },
    "Part": {
        "type": "object",
        "description": "A served decoder or encoder (more fields: README, GET /models).",
        "required": ["name", "family", "config", "device", "dtype", "path", "mode"],
        "properties": {
            "name": {"type": "string"},
            "family": {"type": "string"},
            "config": {"type": "object"},
            "device": {"type": "string"},
            "dtype": {"type": "string"},
            "path": {"type": "string", "enum": ["exact", "optimized"]},
            "parity_cosine": {"type": "number"},
            "fallback": {"type": "boolean"},
            "mode": {"type": "string"},
            "candidates": {"type": "array", "items": {"type": "object"}},
            "state": {"type": "string"},
        },
    },
    "Model": {
        "allOf": [
            ref("Part"),
            {
                "type": "object",
                "required": ["encoder"],
                "properties": {
                    "encoder": {
                        "description": "null: a decoder-only entry; `{error}`: its encoder "
                        "failed to load",
                        "anyOf": [
                            {"type": "null"},
                            ref("Part"),
                            {
                                "type": "object",
                                "required": ["error"],
                                "properties": {"error": {"type": "string"}},
                            },
                        ],
                    }
                },
            },
        ]
    },
    "Models": {
        "type": "object",
        "required": ["models", "errors", "loading", "states", "default"],
        "properties": {
            "models": {"type": "array", "items": ref("Model")},
            "errors": {"type": "object", "additionalProperties": {"type": "string"}},
            "loading": {"type": "boolean"},
            "states": {"type": "object", "additionalProperties": ref("ModelState")},
            "default": {"type": ["string", "null"], "description": "VAE_DEFAULT_MODEL"},
        },
        "additionalProperties": False,
    },
}

DESCRIPTION = """\
`POST /decode` takes a latent and answers its pixels (an image, a tensor or an MP4); \
`POST /encode` takes an image, pixels or an MP4 and answers its latent; both in diffusers' \
remote_decode / remote_encode wire format, which docs/wire-format.md describes in full.

**Errors** are JSON `{"error": ..., "expected": ...}` (`expected` when there is something to \
say), for every status. 429 and 503 from the decode and encode routes carry `Retry-After`. \
Every answer carries `X-Request-Id` and `Server-Timing`.

**Auth**: with VAE_API_TOKENS set, every route but /healthz, /readyz, the page (/) and \
/metrics (unless VAE_PROTECT_METRICS) needs `Authorization: Bearer <token>`, else 401.

Answered before any route, so on any path: 408 when a request's headers take longer than \
VAE_HEADER_TIMEOUT_S, 400 for a request that is not HTTP/1.1, and during a shutdown 503 (with \
`Retry-After`) to a request caught half-received; all with the same JSON error body.
"""


def described(schema: dict[str, Any], app: FastAPI) -> dict[str, Any]:
    """FastAPI's generated schema, each operation's params, body and answers replaced by
    ``OPERATIONS``' (and the served ``HIDDEN_OPERATIONS`` added)."""
    schema = copy.deepcopy(schema)
    paths = schema.setdefault("paths", {})
    for path, item in paths.items():
        for method, operation in item.items():
            entry = OPERATIONS.get((method, path))
            if entry is None:
                raise RuntimeError(
                    f"{method.upper()} {path} is in the schema but app/http/openapi.py does not "
                    "describe it (OPERATIONS)"
                )
            for key in ("parameters", "requestBody", "responses"):
                operation.pop(key, None)
            operation.update(copy.deepcopy(entry))
    served = {
        (method.lower(), route.path)
        for route in app.routes
        if isinstance(route, APIRoute)
        for method in route.methods
    }
    for (method, path), entry in HIDDEN_OPERATIONS.items():
        if (method, path) in served:
            paths.setdefault(path, {})[method] = copy.deepcopy(entry)
    components = schema.setdefault("components", {})
    components["schemas"] = copy.deepcopy(SCHEMAS)  # FastAPI's were its own 422's only
    components["securitySchemes"] = {
        "bearer": {
            "type": "http",
            "scheme": "bearer",
            "description": "one of VAE_API_TOKENS; no auth when it is unset",
        }
    }
    schema["security"] = [{}, {"bearer": []}]  # a token where VAE_API_TOKENS is set
    schema.setdefault("info", {})["description"] = DESCRIPTION
    return schema


def install_openapi(app: FastAPI) -> None:
    """``app.openapi()`` (and so ``GET /openapi.json``) answers the described schema, built
    once on first use (FastAPI's documented way to extend its schema)."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:  # FastAPI's generate() caches its own there first
            app.openapi_schema = described(generate(), app)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
