// The page for people (GET /): the served models, refreshed from GET /models, and two try-it
// forms: an image encoded and decoded back (shown side by side with its PSNR), and a latent
// file decoded to an image or a video. A plain ES module; every call goes to this origin and
// carries the token typed in above (kept in sessionStorage), as `Authorization: Bearer`.

const TOKEN_KEY = "vae-token";
const REFRESH_MS = 3000;
const HEADER_BYTES = 1 << 16; // enough for a latent file's header
const LATENT_TYPES = { npy: "application/x-npy", safetensors: "application/x-safetensors" };

const $ = (id) => document.getElementById(id);
const lastCalls = new Map(); // model -> kind -> the phases of the last such answer received
let refreshing = false;

// ---- the API -------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(message, status = null, expected = null) {
    super(message);
    this.status = status;
    this.expected = expected;
  }
}

async function api(path, init = {}) {
  const headers = new Headers(init.headers);
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.set("Authorization", `Bearer ${token}`);
  const response = await fetch(path, { ...init, headers });
  if (response.ok) return response;
  let body = {};
  try {
    body = await response.json(); // every error of the service is {"error", "expected"}
  } catch {
    body = { error: response.statusText };
  }
  throw new ApiError(body.error || `HTTP ${response.status}`, response.status, body.expected);
}

// `Server-Timing: parse;dur=0.88, queue;dur=11.7, ...` -> [{name, ms}]
function phasesOf(response) {
  return (response.headers.get("Server-Timing") || "")
    .split(",")
    .map((part) => part.trim().split(";"))
    .filter(([name]) => name)
    .map(([name, ...params]) => {
      const dur = params.map((p) => p.trim()).find((p) => p.startsWith("dur="));
      return { name: name.trim(), ms: dur ? Number(dur.slice(4)) : NaN };
    });
}

function remember(model, kind, response) {
  const phases = phasesOf(response);
  if (!lastCalls.has(model)) lastCalls.set(model, new Map());
  lastCalls.get(model).set(kind, phases);
  return phases;
}

// ---- small DOM helpers -------------------------------------------------------------------

function el(tag, text = "", className = "") {
  const node = document.createElement(tag);
  if (text !== "") node.textContent = text;
  if (className) node.className = className;
  return node;
}

const ms = (seconds) => `${(seconds * 1000).toFixed(1)}`;
const phaseText = (phases) => phases.map((p) => `${p.name} ${p.ms.toFixed(1)}`).join(" · ");

function showPhases(target, calls) {
  target.replaceChildren(
    ...calls.map(([label, phases]) => {
      const line = el("p");
      line.append(el("strong", `${label}: `), phaseText(phases));
      return line;
    }),
  );
}

function showError(target, error) {
  const status = error.status ? `${error.status}: ` : "";
  target.replaceChildren(el("strong", `${status}${error.message}`));
  if (error.expected) target.append(el("span", ` expected: ${error.expected}`));
  if (error.status === 401) target.append(el("span", " (type the API token above)"));
  target.hidden = false;
}

const blobUrls = new Map(); // element id -> its blob: URL, revoked when replaced
function showBlob(media, blob) {
  if (blobUrls.has(media.id)) URL.revokeObjectURL(blobUrls.get(media.id));
  const url = URL.createObjectURL(blob);
  blobUrls.set(media.id, url);
  media.src = url;
  media.hidden = false;
}

// ---- the models table ----------------------------------------------------------------------

function encoderText(encoder) {
  if (encoder === null || encoder === undefined) return "none";
  if (encoder.error) return `failed: ${encoder.error}`;
  return `${encoder.mode} (${encoder.device})`;
}

const COLUMNS = ["name", "family", "state", "device", "mode", "path", "parity", "fallback",
  "encoder", "load"];

function modelRow(name, model, state, error) {
  const row = el("tr");
  row.dataset.model = name;
  const cells = model
    ? [
        name,
        model.family,
        model.state,
        model.device,
        model.mode || model.dtype,
        model.path,
        model.parity_cosine === null ? "—" : model.parity_cosine.toFixed(6),
        model.fallback ? `yes: ${model.fallback_reason}` : "no",
        encoderText(model.encoder),
        Object.entries(model.phase_seconds || {})
          .map(([phase, s]) => `${phase} ${ms(s)}`)
          .join(" · "),
      ]
    : [name, "", state, "", "", "", "", "", "", error || ""];
  cells.forEach((text, i) => row.append(el("td", String(text ?? ""), COLUMNS[i])));
  row.querySelector("td.state").classList.add(`state-${model ? model.state : state}`);
  const last = el("td", "", "last");
  for (const [kind, phases] of lastCalls.get(name) || []) {
    last.append(el("div", `${kind}: ${phaseText(phases)}`));
  }
  row.append(last);
  return row;
}

function renderModels(body) {
  const served = new Map(body.models.map((m) => [m.name, m]));
  const states = body.states || {};
  const names = [...new Set([...Object.keys(states), ...served.keys()])].sort();
  $("models")
    .tBodies[0].replaceChildren(
      ...names.map((n) => modelRow(n, served.get(n), states[n]?.state, body.errors?.[n])),
    );
  const withEncoder = body.models.filter((m) => m.encoder && !m.encoder.error);
  fillSelect($("roundtrip").elements.model, withEncoder);
  fillSelect($("latent").elements.model, body.models);
  const loading = body.loading ? "loading…" : "";
  $("models-status").textContent = loading;
}

function fillSelect(select, models) {
  const names = models.map((m) => m.name);
  const now = [...select.options].map((o) => o.value);
  if (names.join("\n") === now.join("\n")) return; // keep the visitor's choice
  const chosen = select.value;
  select.replaceChildren(
    ...models.map((m) => {
      const option = el("option", `${m.name} (${m.family}${m.config?.video ? ", video" : ""})`);
      option.value = m.name;
      return option;
    }),
  );
  if (names.includes(chosen)) select.value = chosen;
}

let refused = false; // the last GET /models was a 401: no polling until a token is typed

async function refresh(event) {
  if (refreshing || document.hidden) return; // a background tab polls nothing
  if (refused && event === "poll") return; // a 401 every few seconds says nothing new
  refreshing = true;
  try {
    renderModels(await (await api("/models")).json());
    refused = false;
  } catch (error) {
    refused = error.status === 401;
    const typed = Boolean(sessionStorage.getItem(TOKEN_KEY));
    // with a token typed, the service's own words ("invalid bearer token"), not a request for one
    const why = typed ? `the token was refused (${error.message}): type the right one above` : "";
    const hint = refused ? why || "this service needs a token: type it above" : "";
    $("models-status").textContent = hint || `GET /models failed: ${error.message}`;
  } finally {
    refreshing = false;
  }
}

// ---- images and PSNR -----------------------------------------------------------------------

async function loadImage(img, blob) {
  showBlob(img, blob);
  await img.decode();
  return img;
}

// the RGBA pixels of `img` drawn at width x height (the original is resized the way the
// service resizes it: down to the decoded size, a multiple of the model's scale)
function pixels(img, width, height) {
  const canvas = el("canvas");
  canvas.width = width;
  canvas.height = height;
  const context = canvas.getContext("2d", { willReadFrequently: true });
  context.imageSmoothingQuality = "high";
  context.drawImage(img, 0, 0, width, height);
  return context.getImageData(0, 0, width, height).data;
}

// PSNR in dB over the RGB channels of two 8-bit images of the decoded image's size
function psnr(original, decoded) {
  const [w, h] = [decoded.naturalWidth, decoded.naturalHeight];
  const a = pixels(original, w, h);
  const b = pixels(decoded, w, h);
  let sum = 0;
  for (let i = 0; i < a.length; i += 4) {
    for (let c = 0; c < 3; c++) sum += (a[i + c] - b[i + c]) ** 2;
  }
  const mse = sum / (w * h * 3);
  return mse === 0 ? Infinity : 10 * Math.log10((255 * 255) / mse);
}

// ---- try it: an image encoded, then decoded back ---------------------------------------------

async function roundTrip(form) {
  const file = form.elements.image.files[0];
  const model = form.elements.model.value;
  const path = encodeURIComponent(model);
  // the image's bytes as the body, Content-Type the file's type (fetch sets it from the File)
  const encoded = await api(`/encode/${path}`, {
    method: "POST",
    body: file,
    headers: { Accept: "tensor/binary" },
  });
  const encodePhases = remember(model, "encode", encoded);
  const shape = JSON.parse(encoded.headers.get("shape"));
  const query = new URLSearchParams(shape.map((n) => ["shape", String(n)]));
  query.set("dtype", encoded.headers.get("dtype"));
  query.set("output_type", "pil");
  query.set("image_format", "png");
  const decoded = await api(`/decode/${path}?${query}`, {
    method: "POST",
    body: await encoded.arrayBuffer(),
    headers: { "Content-Type": "tensor/binary" },
  });
  const decodePhases = remember(model, "decode", decoded);
  const original = await loadImage($("rt-original"), file);
  const output = await loadImage($("rt-decoded"), await decoded.blob());
  const db = psnr(original, output);
  $("rt-psnr").textContent = Number.isFinite(db) ? db.toFixed(2) : "∞";
  $("rt-psnr").dataset.db = String(db);
  $("rt-original-caption").textContent =
    `original, ${original.naturalWidth}×${original.naturalHeight}`;
  $("rt-decoded-caption").textContent =
    `decoded by ${model}, ${output.naturalWidth}×${output.naturalHeight} ` +
    `(latent [${shape.join(", ")}])`;
  showPhases($("rt-phases"), [
    [`encode (POST /encode/${model})`, encodePhases],
    [`decode (POST /decode/${model})`, decodePhases],
  ]);
  $("roundtrip-result").hidden = false;
}

// ---- try it: a latent file decoded -----------------------------------------------------------

// the shape a .npy or .safetensors file's header declares (null where it cannot be read),
// from the file's first bytes
function latentShape(kind, bytes) {
  const view = new DataView(bytes);
  try {
    if (kind === "npy") {
      const v1 = view.getUint8(6) === 1; // format 1.0: a 2-byte header length, else 4 bytes
      const [length, start] = v1 ? [view.getUint16(8, true), 10] : [view.getUint32(8, true), 12];
      const header = new TextDecoder().decode(new Uint8Array(bytes, start, length));
      const match = header.match(/'shape':\s*\(([^)]*)\)/);
      return match[1].split(",").filter((s) => s.trim()).map(Number);
    }
    const length = Number(view.getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(bytes, 8, length)));
    const [name] = Object.keys(header).filter((k) => k !== "__metadata__");
    return header[name].shape;
  } catch {
    return null;
  }
}

async function decodeLatent(form) {
  const file = form.elements.latent.files[0];
  const model = form.elements.model.value;
  const kind = file.name.split(".").pop().toLowerCase();
  if (!LATENT_TYPES[kind]) {
    throw new ApiError(`${file.name}: not a latent file`, null, "a .npy or .safetensors file");
  }
  const shape = latentShape(kind, await file.slice(0, HEADER_BYTES).arrayBuffer());
  const output = form.elements.output.value;
  const video = output === "mp4" || (output === "auto" && shape?.length === 5 && shape[2] > 1);
  const query = new URLSearchParams(
    video ? { output_type: "mp4" } : { output_type: "pil", image_format: "png" },
  );
  const response = await api(`/decode/${encodeURIComponent(model)}?${query}`, {
    method: "POST",
    body: file,
    headers: { "Content-Type": LATENT_TYPES[kind] },
  });
  const phases = remember(model, video ? "decode (mp4)" : "decode", response);
  const type = response.headers.get("Content-Type") || "";
  if (!type.startsWith(video ? "video/" : "image/")) {
    const expected = video ? null : "a 4-D latent for an image, or MP4 for a video latent";
    throw new ApiError(`the service answered ${type}, not ${video ? "an MP4" : "an image"}`,
      null, expected);
  }
  const blob = await response.blob(); // an MP4 arrives as it is decoded: all of it first
  const [image, player] = [$("lt-image"), $("lt-video")];
  (video ? image : player).hidden = true;
  if (video) {
    showBlob(player, blob);
  } else {
    await loadImage(image, blob);
  }
  const size = video ? "" : `, ${image.naturalWidth}×${image.naturalHeight}`;
  const dims = shape ? `latent [${shape.join(", ")}]` : "latent";
  $("lt-caption").textContent = `${dims} decoded by ${model} to ${type}${size}`;
  const label = video
    ? `decode (POST /decode/${model}, to the first frame)`
    : `decode (POST /decode/${model})`;
  showPhases($("lt-phases"), [[label, phases]]);
  $("latent-result").hidden = false;
}

// ---- wiring ------------------------------------------------------------------------------------

function onSubmit(form, errorBox, result, run) {
  form.addEventListener("submit", async (event) => {
    event.preventDefault();
    const busy = form.querySelector(".busy");
    const button = form.querySelector("button[type=submit]");
    errorBox.hidden = true;
    result.hidden = true; // the last run's result is not this one's: shown again on success
    busy.hidden = false;
    button.disabled = true;
    try {
      await run(form);
    } catch (error) {
      showError(errorBox, error);
    } finally {
      busy.hidden = true;
      button.disabled = false;
      refresh();
    }
  });
}

function showTokenState() {
  const set = Boolean(sessionStorage.getItem(TOKEN_KEY));
  $("token-state").textContent = set ? "a token is set for this tab" : "";
}

$("token-form").addEventListener("submit", (event) => {
  event.preventDefault();
  const value = $("token").value.trim();
  if (value) sessionStorage.setItem(TOKEN_KEY, value);
  $("token").value = "";
  showTokenState();
  refresh();
});
$("token-forget").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  showTokenState();
  refresh();
});

onSubmit($("roundtrip"), $("roundtrip-error"), $("roundtrip-result"), roundTrip);
onSubmit($("latent"), $("latent-error"), $("latent-result"), decodeLatent);
showTokenState();
refresh();
setInterval(() => refresh("poll"), REFRESH_MS);
document.addEventListener("visibilitychange", refresh);
