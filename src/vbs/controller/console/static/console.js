// The VBS web console: one module, no framework. Every byte shown from the API goes through
// textContent or an attribute value, never parsed as HTML: tags, comments and names are user input.
// The access key lives in sessionStorage (this tab only) and travels in the Authorization header only.

const KEY_STORAGE = "vbs.console.key";
const COLUMNS_STORAGE = "vbs.console.columns";
const BUSY_POLL_MS = 500;   // while something runs: the live progress
const IDLE_POLL_MS = 4000;  // otherwise: enough to see what others do
const BUSY_VOLUME = new Set(["creating", "deleting"]);
const BUSY_ATTACHMENT = new Set(["attaching", "detaching"]);
const BUSY_OPERATION = new Set(["running", "rolling-back"]);

const $ = (id) => document.getElementById(id);

// -- DOM ------------------------------------------------------------------------------------------

/** An element with attributes (strings set as attributes, functions as listeners) and children
 * (strings become text nodes: never parsed as HTML). */
function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs)) {
    if (value === null || value === undefined || value === false) continue;
    if (typeof value === "function") node.addEventListener(name, value);
    else node.setAttribute(name, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === null || child === undefined || child === false) continue;
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

/** ``state`` in a coloured pill; ``look`` names the colour where the word alone would mislead. */
function badge(state, look = state) {
  return el("span", { class: `badge s-${String(look).replace(/[^a-z-]/g, "")}` }, state);
}

function when(iso) {
  if (!iso) return "";
  const d = new Date(iso);
  return Number.isNaN(d.getTime()) ? String(iso) : d.toISOString().replace("T", " ").slice(0, 19) + "Z";
}

const UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];

function size(bytes) {
  let n = bytes;
  let unit = 0;
  while (n >= 1024 && unit < UNITS.length - 1) {
    n /= 1024;
    unit += 1;
  }
  return `${n.toFixed(n >= 10 || unit === 0 ? 0 : 1)} ${UNITS[unit]}`;
}

function meter(used, total) {
  const pct = total > 0 ? Math.min(100, Math.round((100 * used) / total)) : 0;
  const bar = el("span", { class: "meter", title: `${pct} %` }, el("span", { class: "fill" }));
  bar.firstChild.style.width = `${Math.max(pct, used > 0 ? 1 : 0)}%`;
  return el("span", { class: "usage" }, bar, ` ${size(used)} of ${size(total)} (${pct} %)`);
}

let sayTimer = null;

/** A line above the page; news fades after a while, an error stays until the next action. */
function say(text, kind = "info") {
  const box = $("message");
  box.textContent = text;
  box.className = `message ${kind}`;
  box.hidden = !text;
  clearTimeout(sayTimer);
  if (text && kind === "info") sayTimer = setTimeout(() => { box.hidden = true; }, 8000);
}

// -- the API --------------------------------------------------------------------------------------

class ApiError extends Error {
  constructor(status, code, message) {
    super(message);
    this.status = status;
    this.code = code;
  }
  toString() {
    return `${this.code}: ${this.message}`;
  }
}

function storedKey() {
  try {
    return JSON.parse(sessionStorage.getItem(KEY_STORAGE) || "null");
  } catch {
    return null;
  }
}

async function call(method, path, body, key = storedKey()) {
  if (!key) throw new ApiError(401, "AuthFailure", "not signed in");
  const init = { method, headers: { authorization: `Bearer ${key.id}:${key.secret}` }, cache: "no-store" };
  if (body !== undefined) {
    init.headers["content-type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  let resp;
  try {
    resp = await fetch(path, init);
  } catch (exc) {
    throw new ApiError(0, "Unreachable", `the controller did not answer (${exc.message})`);
  }
  const text = await resp.text();
  let data = null;
  try {
    data = text ? JSON.parse(text) : null;
  } catch {
    data = null;
  }
  if (!resp.ok) {
    const err = data && data.error ? data.error : {};
    throw new ApiError(resp.status, err.code || `HTTP${resp.status}`, err.message || resp.statusText);
  }
  return data;
}

/** Every item of a describe, page after page. */
async function all(path, field, params = []) {
  const found = [];
  let token = null;
  do {
    const query = new URLSearchParams([["max_results", "1000"], ...params]);
    if (token) query.set("next_token", token);
    const page = await call("GET", `${path}?${query}`);
    found.push(...page[field]);
    token = page.next_token;
  } while (token);
  return found;
}

const api = {
  volumes: (params) => all("/v1/volumes", "volumes", params),
  volume: (id) => call("GET", `/v1/volumes/${encodeURIComponent(id)}`),
  snapshots: () => all("/v1/snapshots", "snapshots"),
  instances: () => all("/v1/instances", "instances"),
  hosts: () => all("/v1/hosts", "hosts"),
  storageNodes: () => all("/v1/storage-nodes", "storage_nodes"),
  operations: (id) => call("GET", `/v1/operations?${new URLSearchParams({ resource_id: id, max_results: "50" })}`),
  createVolume: (body) => call("POST", "/v1/volumes", body),
  deleteVolume: (id) => call("DELETE", `/v1/volumes/${encodeURIComponent(id)}`),
  attach: (id, body) => call("POST", `/v1/volumes/${encodeURIComponent(id)}/attach`, body),
  detach: (id, body) => call("POST", `/v1/volumes/${encodeURIComponent(id)}/detach`, body),
  createSnapshot: (body) => call("POST", "/v1/snapshots", body),
  deleteSnapshot: (id) => call("DELETE", `/v1/snapshots/${encodeURIComponent(id)}`),
  snapshotLocks: () => call("GET", "/v1/snapshot-locks").then((answer) => answer.locks),
  rules: (type) => all("/v1/recycle-bin/rules", "rules", [["resource_type", type]]),
  binSnapshots: () => all("/v1/recycle-bin/snapshots", "snapshots"),
  binVolumes: () => all("/v1/recycle-bin/volumes", "volumes"),
  restore: (kind, id) => call("POST", `/v1/recycle-bin/${kind}/${encodeURIComponent(id)}/restore`),
  policies: () => call("GET", "/v1/lifecycle-policies").then((answer) => answer.policies),
};

// -- session --------------------------------------------------------------------------------------

const session = { admin: false };

async function signIn(event) {
  event.preventDefault();
  const key = { id: $("key-id").value.trim(), secret: $("key-secret").value };
  $("sign-in-error").textContent = "";
  try {
    await call("GET", "/v1/volumes?max_results=1", undefined, key);
  } catch (exc) {
    $("sign-in-error").textContent = exc.status === 401 || exc.status === 403
      ? `Sign-in refused: ${exc.message}` : `Sign-in failed: ${exc}`;
    return;
  }
  sessionStorage.setItem(KEY_STORAGE, JSON.stringify(key));
  $("key-secret").value = "";
  await startSession();
}

async function startSession() {
  const key = storedKey();
  try {
    await call("GET", "/v1/hosts?max_results=1");
    session.admin = true;
  } catch (exc) {
    if (exc.status === 401) return signOut("The stored key is no longer accepted: sign in again.");
    session.admin = false;
  }
  $("who").textContent = `${key.id} (${session.admin ? "admin" : "user"})`;
  $("sign-in").hidden = true;
  $("nav").hidden = false;
  $("sign-out").hidden = false;
  route();
}

function signOut(why = "") {
  sessionStorage.removeItem(KEY_STORAGE);
  stopPolling();
  for (const view of document.querySelectorAll(".view")) view.hidden = true;
  $("nav").hidden = true;
  $("sign-out").hidden = true;
  $("who").textContent = "";
  say("");
  $("sign-in").hidden = false;
  $("sign-in-error").textContent = why;
  if (location.hash) history.replaceState(null, "", location.pathname);
}

// -- routing and polling --------------------------------------------------------------------------

let timer = null;
let generation = 0;

function stopPolling() {
  clearTimeout(timer);
  timer = null;
  generation += 1;
}

/** Run ``load`` now and again after BUSY_POLL_MS while it answers true (something runs), else IDLE_POLL_MS. */
function poll(load) {
  stopPolling();
  const mine = generation;
  const tick = async () => {
    let busy = false;
    try {
      busy = await load(() => mine === generation);
    } catch (exc) {
      if (mine !== generation) return;
      if (exc.status === 401) return signOut(`Signed out: ${exc.message}`);
      say(String(exc), "error");
    }
    if (mine === generation) timer = setTimeout(tick, busy ? BUSY_POLL_MS : IDLE_POLL_MS);
  };
  tick();
}

function route() {
  if (!storedKey()) return signOut();
  const [, view = "volumes", id = ""] = location.hash.split("/");
  for (const section of document.querySelectorAll(".view")) section.hidden = true;
  for (const link of document.querySelectorAll("#nav a")) {
    link.classList.toggle("active", link.dataset.view === view || (view === "volume" && link.dataset.view === "volumes"));
  }
  say("");
  // The views that poll one table, each in its section #view-<name>.
  const polled = { snapshots: renderSnapshots, "recycle-bin": renderRecycleBin, policies: renderPolicies,
                   infrastructure: renderInfrastructure };
  if (view === "volume" && /^vol-[0-9a-f]{17}$/.test(id)) {
    $("view-volume").hidden = false;
    volumePage.open(id);
  } else if (Object.prototype.hasOwnProperty.call(polled, view)) {
    $(`view-${view}`).hidden = false;
    poll(polled[view]);
  } else {
    $("view-volumes").hidden = false;
    poll(volumesPage.load);
  }
}

// -- the volumes table ----------------------------------------------------------------------------

const tagOf = (v, key) => (v.tags && Object.prototype.hasOwnProperty.call(v.tags, key) ? v.tags[key] : "");
const volumeLink = (id) => el("a", { href: `#/volume/${id}`, class: "mono" }, id);

function tagList(tags) {
  return el("span", { class: "tags" }, Object.entries(tags || {}).map(([k, v]) => el("span", { class: "tag" }, `${k}=${v}`)));
}

function statusCell(v) {
  const cell = el("span", {}, badge(v.status));
  if (v.status === "creating") cell.append(` ${v.progress} %`);
  return cell;
}

const VOLUME_COLUMNS = [
  { id: "name", label: "Name", value: (v) => tagOf(v, "Name"), on: true },
  { id: "status", label: "Status", value: statusCell, on: true },
  { id: "size", label: "Size", value: (v) => `${v.size_gib} GiB`, on: true },
  { id: "used", label: "Used", value: (v) => usedCell(v), on: true },
  { id: "type", label: "Type", value: (v) => v.volume_type, on: true },
  { id: "attached", label: "Attached to", on: true,
    value: (v) => v.attachments.map((a) => `${a.instance_id || `${a.host}/${a.vm_id}`} (${a.device}, ${a.state})`).join(", ") },
  { id: "snapshot", label: "From snapshot", value: (v) => v.snapshot_id || "", on: true },
  { id: "node", label: "Storage node", value: (v) => `${v.storage_node}/${v.pool}`, on: false },
  { id: "zone", label: "Zone", value: (v) => v.availability_zone, on: false },
  { id: "health", label: "Volume status", value: (v) => v.volume_status, on: false },
  { id: "tags", label: "Tags", value: (v) => tagList(v.tags), on: true },
  { id: "comment", label: "Comment", value: (v) => v.comment, on: false },
  { id: "created", label: "Created", value: (v) => when(v.created_at), on: true },
];

/** Size against what the volume's storage holds for it (as of its node's last heartbeat), where the
 * API reports it: a file pool does, RBD does not. */
function usedCell(v) {
  if (typeof v.used_bytes !== "number") return "";
  return meter(v.used_bytes, v.size_gib * 2 ** 30);
}

const volumesPage = {
  volumes: [],
  selected: new Set(),

  columns() {
    let chosen = null;
    try {
      chosen = JSON.parse(localStorage.getItem(COLUMNS_STORAGE) || "null");
    } catch {
      chosen = null;
    }
    return VOLUME_COLUMNS.filter((c) => (Array.isArray(chosen) ? chosen.includes(c.id) : c.on));
  },

  setupColumnChoices() {
    const shown = new Set(this.columns().map((c) => c.id));
    $("column-choices").replaceChildren(...VOLUME_COLUMNS.map((c) => el("label", { class: "check" },
      el("input", { type: "checkbox", value: c.id, checked: shown.has(c.id), change: () => this.chooseColumns() }),
      ` ${c.label}`)));
  },

  chooseColumns() {
    const ids = [...$("column-choices").querySelectorAll("input:checked")].map((i) => i.value);
    localStorage.setItem(COLUMNS_STORAGE, JSON.stringify(ids));
    this.render();
  },

  apiFilters() {
    const filters = [];
    const status = $("filter-status").value;
    if (status) filters.push(["filter", `status=${status}`]);
    const tag = $("filter-tag").value.trim();
    if (tag) {
      const [k, ...rest] = tag.split("=");
      filters.push(["filter", rest.length ? `tag:${k.trim()}=${rest.join("=").trim()}` : `tag-key=${k.trim()}`]);
    }
    return filters;
  },

  load: async (current) => {
    const page = volumesPage;
    const volumes = await api.volumes(page.apiFilters());
    if (!current()) return false;
    page.volumes = volumes;
    page.render();
    return volumes.some((v) => BUSY_VOLUME.has(v.status) || v.attachments.some((a) => BUSY_ATTACHMENT.has(a.state)));
  },

  matches(v) {
    // Gone is gone: a deleted volume shows only when the status filter asks for deleted ones.
    if (v.status === "deleted" && $("filter-status").value !== "deleted") return false;
    const text = $("filter-text").value.trim().toLowerCase();
    if (!text) return true;
    const hay = [v.volume_id, v.status, v.comment, v.snapshot_id || "", v.volume_type,
      ...Object.entries(v.tags || {}).flat(), ...v.attachments.map((a) => a.instance_id || "")];
    return hay.some((s) => String(s).toLowerCase().includes(text));
  },

  render() {
    const columns = this.columns();
    const allBox = el("input", { type: "checkbox", id: "select-all", title: "Select all shown",
      change: (e) => this.selectAll(e.target.checked) });
    $("volumes-head").replaceChildren(el("th", {}, allBox), el("th", {}, "Volume"),
      ...columns.map((c) => el("th", {}, c.label)));
    const shown = this.volumes.filter((v) => this.matches(v));
    const known = new Set(shown.map((v) => v.volume_id));
    for (const id of [...this.selected]) if (!known.has(id)) this.selected.delete(id);
    $("volumes-body").replaceChildren(...shown.map((v) => el("tr", { "data-volume-id": v.volume_id },
      el("td", {}, el("input", { type: "checkbox", class: "select", value: v.volume_id,
        checked: this.selected.has(v.volume_id), change: (e) => this.select(v.volume_id, e.target.checked) })),
      el("td", {}, volumeLink(v.volume_id)),
      ...columns.map((c) => el("td", { class: `c-${c.id}` }, c.value(v))))));
    allBox.checked = shown.length > 0 && shown.every((v) => this.selected.has(v.volume_id));
    $("volumes-empty").hidden = shown.length > 0;
    this.updateBulk();
  },

  select(id, on) {
    if (on) this.selected.add(id);
    else this.selected.delete(id);
    this.updateBulk();
  },

  selectAll(on) {
    for (const v of this.volumes.filter((x) => this.matches(x))) this.select(v.volume_id, on);
    this.render();
  },

  updateBulk() {
    const n = this.selected.size;
    $("bulk-delete").disabled = n === 0;
    $("bulk-delete").textContent = n ? `Delete selected (${n})` : "Delete selected";
  },

  askBulkDelete() {
    $("bulk-confirm-text").textContent = `Delete ${this.selected.size} volume(s): ${[...this.selected].join(", ")}?`;
    $("bulk-confirm").hidden = false;
  },

  async bulkDelete() {
    $("bulk-confirm").hidden = true;
    const ids = [...this.selected];
    const failed = [];
    for (const id of ids) {
      try {
        await api.deleteVolume(id);
        this.selected.delete(id);
      } catch (exc) {
        failed.push(`${id}: ${exc}`);
      }
    }
    say(failed.length ? `Not deleted: ${failed.join("; ")}` : `Deleting ${ids.length} volume(s).`,
      failed.length ? "error" : "info");
    poll(this.load);
  },

  async openCreate() {
    const form = $("create-volume-form");
    form.hidden = !form.hidden;
    if (form.hidden) return;
    const snapshots = await api.snapshots();
    $("cv-snapshot").replaceChildren(el("option", { value: "" }, "(empty volume)"),
      ...snapshots.filter((s) => s.status === "completed").map((s) => el("option", { value: s.snapshot_id },
        `${s.snapshot_id} (${s.volume_size_gib} GiB, of ${s.volume_id})`)));
  },

  async create(event) {
    event.preventDefault();
    const body = { volume_type: $("cv-type").value, comment: $("cv-comment").value,
      client_token: crypto.randomUUID() };
    const tags = parseTags($("cv-tags").value);
    if (tags === null) return say("Tags: write key=value pairs separated by commas.", "error");
    body.tags = tags;
    const snapshot = $("cv-snapshot").value;
    if (snapshot) body.snapshot_id = snapshot;
    const size = $("cv-size").value.trim();
    if (size) body.size_gib = Number(size);
    else if (!snapshot) return say("Give a size (GiB).", "error");
    try {
      const made = await api.createVolume(body);
      $("create-volume-form").hidden = true;
      location.hash = `#/volume/${made.volume_id}`;
    } catch (exc) {
      say(`Not created: ${exc}`, "error");
    }
  },
};

function parseTags(text) {
  const tags = {};
  for (const part of text.split(",")) {
    if (!part.trim()) continue;
    const at = part.indexOf("=");
    if (at <= 0) return null;
    tags[part.slice(0, at).trim()] = part.slice(at + 1).trim();
  }
  return tags;
}

// -- one volume -----------------------------------------------------------------------------------

const volumePage = {
  id: null,
  armedDelete: false,

  open(id) {
    this.id = id;
    this.armedDelete = false;
    $("vd-delete").textContent = "Delete volume";
    poll((current) => this.load(current));
  },

  async load(current) {
    const id = this.id;
    const [volume, ops, snapshots, volumes, instances] = await Promise.all([
      api.volume(id), api.operations(id), api.snapshots(), api.volumes(), api.instances()]);
    if (!current()) return false;
    this.render(volume, ops.operations, snapshots, volumes, instances);
    const mySnapshots = snapshots.filter((s) => s.volume_id === id);
    return BUSY_VOLUME.has(volume.status) || volume.attachments.some((a) => BUSY_ATTACHMENT.has(a.state))
      || ops.operations.some((o) => BUSY_OPERATION.has(o.status)) || mySnapshots.some((s) => s.status === "pending");
  },

  render(v, operations, snapshots, volumes, instances) {
    $("vd-title").textContent = tagOf(v, "Name") ? `${tagOf(v, "Name")} (${v.volume_id})` : v.volume_id;
    $("vd-status").replaceChildren(badge(v.status));
    $("vd-progress").hidden = v.status !== "creating";
    $("vd-progress-bar").style.width = `${v.progress}%`;
    $("vd-progress-text").textContent = `${v.progress} %`;
    const rows = [["Volume ID", v.volume_id], ["Size", `${v.size_gib} GiB`], ["Type", v.volume_type],
      ["IOPS", v.iops ?? "—"], ["Throughput", v.throughput ? `${v.throughput} MB/s` : "—"],
      ["Multi-attach", v.multi_attach ? "yes" : "no"], ["Storage", `${v.storage_node}/${v.pool}`],
      ["Zone", v.availability_zone], ["Volume status", v.volume_status],
      ["From snapshot", v.snapshot_id || "—"], ["Created", when(v.created_at)], ["Comment", v.comment || "—"],
      ["Tags", tagList(v.tags)]];
    if (typeof v.used_bytes === "number") rows.splice(2, 0, ["Used", usedCell(v)]);
    if (v.status_reason) rows.push(["Reason", v.status_reason]);
    $("vd-details").replaceChildren(...rows.flatMap(([k, val]) => [el("dt", {}, k), el("dd", {}, val)]));

    $("vd-attachments").replaceChildren(...v.attachments.map((a) => el("tr", { "data-attachment-id": a.attachment_id },
      el("td", { class: "mono" }, a.instance_id || "—"), el("td", {}, `${a.host} / ${a.vm_id}`), el("td", {}, a.device),
      el("td", {}, a.mode), el("td", {}, badge(a.state)),
      el("td", {}, a.state === "attached" || a.state === "busy"
        ? el("button", { type: "button", class: "secondary detach", click: () => this.detach(a) }, "Detach") : ""))));
    $("vd-no-attachments").hidden = v.attachments.length > 0;
    const attachable = v.status === "available" || (v.multi_attach && v.status === "in-use");
    $("attach-form").hidden = !attachable;
    const select = $("attach-instance");
    const chosen = select.value;
    select.replaceChildren(...instances.filter((i) => i.state === "running").map((i) => el("option",
      { value: i.instance_id }, `${i.name || i.vm_id} — ${i.instance_id} on ${i.host}`)));
    if ([...select.options].some((o) => o.value === chosen)) select.value = chosen;
    $("attach-submit").disabled = select.options.length === 0;

    $("snapshot-form").hidden = !(v.status === "available" || v.status === "in-use");
    $("vd-lineage").replaceChildren(lineage(v, snapshots, volumes));
    $("vd-operations").replaceChildren(...operations.map(operationItem));
    if (!operations.length) $("vd-operations").append(el("li", { class: "hint" }, "No recent operations."));
    $("vd-delete").hidden = v.status !== "available" && v.status !== "error";
  },

  async attach(event) {
    event.preventDefault();
    const body = { instance_id: $("attach-instance").value, device: $("attach-device").value.trim(),
      read_only: $("attach-ro").checked };
    try {
      await api.attach(this.id, body);
      say(`Attaching ${this.id} to ${body.instance_id}.`);
    } catch (exc) {
      say(`Not attached: ${exc}`, "error");
    }
    poll((current) => this.load(current));
  },

  async detach(att) {
    try {
      await api.detach(this.id, att.instance_id ? { instance_id: att.instance_id } : {});
      say(`Detaching ${this.id}.`);
    } catch (exc) {
      say(`Not detached: ${exc}`, "error");
    }
    poll((current) => this.load(current));
  },

  async snapshot(event) {
    event.preventDefault();
    try {
      const snap = await api.createSnapshot({ volume_id: this.id, comment: $("snapshot-comment").value });
      $("snapshot-comment").value = "";
      say(`Snapshot ${snap.snapshot_id} started.`);
    } catch (exc) {
      say(`No snapshot: ${exc}`, "error");
    }
    poll((current) => this.load(current));
  },

  async remove() {
    if (!this.armedDelete) {
      this.armedDelete = true;
      $("vd-delete").textContent = "Confirm: delete this volume";
      return;
    }
    try {
      await api.deleteVolume(this.id);
      say(`Deleting ${this.id}.`);
      location.hash = "#/volumes";
    } catch (exc) {
      say(`Not deleted: ${exc}`, "error");
    }
  },
};

async function volumeFromSnapshot(snapshotId) {
  try {
    const made = await api.createVolume({ snapshot_id: snapshotId, client_token: crypto.randomUUID() });
    location.hash = `#/volume/${made.volume_id}`;
  } catch (exc) {
    say(`Not created: ${exc}`, "error");
  }
}

/** The family of volume ``v``: from its oldest known ancestor down, volume → snapshots → volumes
 * made from each snapshot → …; ``v`` itself is marked. */
function lineage(v, snapshots, volumes) {
  const snapById = new Map(snapshots.map((s) => [s.snapshot_id, s]));
  const volById = new Map(volumes.map((x) => [x.volume_id, x]));
  volById.set(v.volume_id, v);
  let root = { volume: v };
  const seen = new Set([v.volume_id]);
  for (let cur = v; cur.snapshot_id;) {
    const snap = snapById.get(cur.snapshot_id);
    if (!snap) {
      root = { volume: cur, goneSnapshot: cur.snapshot_id };
      break;
    }
    const parent = volById.get(snap.volume_id);
    if (!parent || seen.has(parent.volume_id)) {
      root = { snapshot: snap };
      break;
    }
    seen.add(parent.volume_id);
    root = { volume: parent };
    cur = parent;
  }
  const volumeNode = (vol, depth) => {
    const label = el("span", { class: vol.volume_id === v.volume_id ? "node current" : "node" },
      "▣ ", vol.volume_id === v.volume_id ? el("strong", { class: "mono" }, vol.volume_id) : volumeLink(vol.volume_id),
      ` ${vol.size_gib} GiB `, badge(vol.status), tagOf(vol, "Name") ? ` ${tagOf(vol, "Name")}` : "");
    const kids = snapshots.filter((s) => s.volume_id === vol.volume_id).map((s) => snapshotNode(s, depth + 1));
    return el("li", { "data-volume-id": vol.volume_id }, label, kids.length ? el("ul", {}, kids) : "");
  };
  const snapshotNode = (snap, depth) => {
    const label = el("span", { class: "node snapshot" }, "◷ ", el("span", { class: "mono" }, snap.snapshot_id), " ",
      badge(snap.status), snap.status === "pending" ? ` ${snap.progress} %` : "", snap.comment ? ` ${snap.comment}` : "",
      snap.status === "completed" ? el("button", { type: "button", class: "small from-snapshot",
        click: () => volumeFromSnapshot(snap.snapshot_id) }, "New volume") : "");
    const kids = depth > 40 ? [] : volumes.filter((x) => x.snapshot_id === snap.snapshot_id)
      .map((x) => volumeNode(x, depth + 1));
    return el("li", { "data-snapshot-id": snap.snapshot_id }, label, kids.length ? el("ul", {}, kids) : "");
  };
  const top = root.snapshot ? snapshotNode(root.snapshot, 0) : volumeNode(root.volume, 0);
  const tree = el("ul", { class: "tree" }, top);
  if (root.snapshot) {
    return el("div", {}, el("p", { class: "hint" }, `${root.snapshot.snapshot_id} is of ${root.snapshot.volume_id}, ` +
      "which no longer exists."), tree);
  }
  if (root.goneSnapshot) {
    return el("div", {}, el("p", { class: "hint" }, `Made from ${root.goneSnapshot}, which no longer exists.`), tree);
  }
  return tree;
}

function operationItem(op) {
  return el("li", { class: `op s-${op.status}`, "data-operation-id": op.operation_id },
    el("div", { class: "op-head" }, el("strong", {}, op.kind), " ", badge(op.status), " ",
      el("span", { class: "hint" }, when(op.created_at)), op.attempts > 1 ? ` (attempt ${op.attempts})` : ""),
    el("ol", { class: "steps" }, op.steps.map((st) => el("li", { class: `step st-${st.state}`,
      title: st.error || st.state }, `${st.name}: ${st.state}`))),
    op.error ? el("div", { class: "error" }, op.error) : "");
}

// -- snapshots and infrastructure -------------------------------------------------------------------

// What the Lock column says: the lock's state and until when (none: no lock, or one that expired).
function lockText(lock) {
  if (!lock || lock.lock_state === "expired") return "—";
  return `${lock.lock_state} until ${when(lock.expires_at)}`;
}

async function renderSnapshots(current) {
  const [snapshots, locks] = await Promise.all([api.snapshots(), api.snapshotLocks()]);
  if (!current()) return false;
  const lockOf = new Map(locks.map((l) => [l.snapshot_id, l]));
  const locked = (s) => lockText(lockOf.get(s.snapshot_id)) !== "—";
  $("snapshots-body").replaceChildren(...snapshots.map((s) => el("tr", { "data-snapshot-id": s.snapshot_id },
    el("td", { class: "mono" }, s.snapshot_id), el("td", {}, volumeLink(s.volume_id)), el("td", {}, `${s.volume_size_gib} GiB`),
    el("td", {}, badge(s.status)), el("td", {}, `${s.progress} %`), el("td", {}, when(s.started_at)), el("td", {}, s.comment),
    el("td", { class: "tier" }, s.storage_tier + (s.restore_expires_at ? ` (restored until ${when(s.restore_expires_at)})` : "")),
    el("td", { class: "lock" }, lockText(lockOf.get(s.snapshot_id))),
    el("td", {}, s.status === "completed" && s.storage_tier !== "archive" ? el("button", { type: "button", class: "small",
      click: () => volumeFromSnapshot(s.snapshot_id) }, "New volume") : "",
    (s.status === "completed" || s.status === "error") && !locked(s) ? el("button", { type: "button", class: "small danger",
      click: async () => {
        try {
          await api.deleteSnapshot(s.snapshot_id);
        } catch (exc) {
          say(`Not deleted: ${exc}`, "error");
        }
        poll(renderSnapshots);
      } }, "Delete") : ""))));
  $("snapshots-empty").hidden = snapshots.length > 0;
  return snapshots.some((s) => s.status === "pending" || s.status === "deleting");
}

// -- the Recycle Bin ----------------------------------------------------------------------------------

const tagText = (t) => (t.value === null || t.value === undefined ? t.key : `${t.key}=${t.value}`);

function ruleKeeps(r) {
  if (r.resource_tags.length) return `tagged ${r.resource_tags.map(tagText).join(" or ")}`;
  const but = r.exclude_resource_tags.map(tagText).join(", ");
  return but ? `every one but ${but}` : "every one";
}

function restoreButton(kind, id) {
  return el("button", { type: "button", class: "small", click: async () => {
    try {
      await api.restore(kind, id);
      say(`${id} restored.`);
    } catch (exc) {
      say(`Not restored: ${exc}`, "error");
    }
    poll(renderRecycleBin);
  } }, "Restore");
}

async function renderRecycleBin(current) {
  const [snapshotRules, volumeRules, snapshots, volumes] = await Promise.all([
    api.rules("EBS_SNAPSHOT"), api.rules("EBS_VOLUME"), api.binSnapshots(), api.binVolumes()]);
  if (!current()) return false;
  const rules = [...snapshotRules, ...volumeRules];
  $("rules-body").replaceChildren(...rules.map((r) => el("tr", { "data-rule-id": r.rule_id },
    el("td", { class: "mono" }, r.rule_id), el("td", {}, r.resource_type === "EBS_SNAPSHOT" ? "snapshots" : "volumes"),
    el("td", {}, `${r.retention_days} days`), el("td", {}, ruleKeeps(r)),
    el("td", {}, r.lock_state + (r.lock_end_time ? ` until ${when(r.lock_end_time)}` : "")), el("td", {}, r.description))));
  $("rules-empty").hidden = rules.length > 0;
  $("bin-snapshots-body").replaceChildren(...snapshots.map((s) => el("tr", { "data-snapshot-id": s.snapshot_id },
    el("td", { class: "mono" }, s.snapshot_id), el("td", { class: "mono" }, s.volume_id), el("td", {}, when(s.entered_at)),
    el("td", {}, when(s.exits_at)), el("td", {}, s.description), el("td", {}, restoreButton("snapshots", s.snapshot_id)))));
  $("bin-snapshots-empty").hidden = snapshots.length > 0;
  $("bin-volumes-body").replaceChildren(...volumes.map((v) => el("tr", { "data-volume-id": v.volume_id },
    el("td", { class: "mono" }, v.volume_id), el("td", {}, `${v.size_gib} GiB`), el("td", {}, v.volume_type),
    el("td", {}, when(v.entered_at)), el("td", {}, when(v.exits_at)), el("td", {}, restoreButton("volumes", v.volume_id)))));
  $("bin-volumes-empty").hidden = volumes.length > 0;
  return false;
}

// A lifecycle policy's schedules, as "name: every 1 hours" or "name: cron(...)".
function schedulesText(details) {
  return (details.Schedules || []).map((sc) => {
    const rule = sc.CreateRule || {};
    return `${sc.Name}: ${rule.CronExpression || `every ${rule.Interval} ${String(rule.IntervalUnit).toLowerCase()}`}`;
  }).join("; ");
}

async function renderPolicies(current) {
  const policies = await api.policies();
  if (!current()) return false;
  $("policies-body").replaceChildren(...policies.map((p) => el("tr", { "data-policy-id": p.policy_id },
    el("td", { class: "mono" }, p.policy_id), el("td", {}, p.description), el("td", {}, badge(p.state.toLowerCase())),
    el("td", {}, `${(p.policy_details.ResourceTypes || []).join(", ")} tagged ${(p.policy_details.TargetTags || [])
      .map((t) => `${t.Key}=${t.Value}`).join(" or ")}`),
    el("td", {}, schedulesText(p.policy_details)),
    el("td", { class: "last-run" }, p.last_run ? [badge(p.last_run.status), " ", when(p.last_run.due_at)] : "none yet"),
    el("td", { class: "error" }, p.last_run && p.last_run.error ? p.last_run.error : ""))));
  $("policies-empty").hidden = policies.length > 0;
  return policies.some((p) => p.last_run && p.last_run.status === "running");
}

async function renderInfrastructure(current) {
  const instances = await api.instances();
  if (!current()) return false;
  $("instances-body").replaceChildren(...instances.map((i) => el("tr", { "data-instance-id": i.instance_id },
    el("td", { class: "mono" }, i.instance_id), el("td", {}, i.name), el("td", {}, i.host), el("td", {}, i.vm_id),
    el("td", {}, badge(i.state, i.state === "running" ? "up" : i.state)), el("td", {}, i.volumes.map((a) => `${a.volume_id} (${a.device})`).join(", ")))));
  const note = $("infrastructure-note");
  if (!session.admin) {
    $("hosts-body").replaceChildren();
    $("storage-body").replaceChildren();
    note.textContent = "Hosts and storage nodes are shown to admin keys only.";
    note.hidden = false;
    return false;
  }
  note.hidden = true;
  const [hosts, nodes] = await Promise.all([api.hosts(), api.storageNodes()]);
  if (!current()) return false;
  $("hosts-body").replaceChildren(...hosts.map((h) => el("tr", { "data-host": h.name },
    el("td", {}, h.name), el("td", {}, badge(h.state)), el("td", {}, h.hypervisor), el("td", {}, h.address),
    el("td", {}, String(h.instances)), el("td", {}, when(h.last_heartbeat)))));
  $("storage-body").replaceChildren(...nodes.flatMap((n) => (n.pools.length ? n.pools : [null]).map((p) =>
    el("tr", { "data-storage-node": n.name },
      el("td", {}, n.name, n.drained ? " (drained)" : ""), el("td", {}, badge(n.state)), el("td", {}, n.availability_zone),
      el("td", {}, p ? p.name : "—"), el("td", {}, p ? `${p.backend} (${p.clone_method})` : ""),
      el("td", {}, p ? size(p.capacity_bytes) : ""),
      el("td", { class: "c-used" }, p ? meter(p.capacity_bytes - p.free_bytes, p.capacity_bytes) : "")))));
  return false;
}

// -- wiring ---------------------------------------------------------------------------------------

function debounce(fn, ms) {
  let t = null;
  return () => {
    clearTimeout(t);
    t = setTimeout(fn, ms);
  };
}

function wire() {
  $("sign-in-form").addEventListener("submit", signIn);
  $("sign-out").addEventListener("click", () => signOut());
  $("show-create-volume").addEventListener("click", () => volumesPage.openCreate().catch((e) => say(String(e), "error")));
  $("cv-cancel").addEventListener("click", () => { $("create-volume-form").hidden = true; });
  $("create-volume-form").addEventListener("submit", (e) => volumesPage.create(e));
  const refetch = () => poll(volumesPage.load);
  $("filter-status").addEventListener("change", refetch);
  $("filter-tag").addEventListener("input", debounce(refetch, 300));
  $("filter-text").addEventListener("input", debounce(() => volumesPage.render(), 150));
  $("bulk-delete").addEventListener("click", () => volumesPage.askBulkDelete());
  $("bulk-confirm-yes").addEventListener("click", () => volumesPage.bulkDelete());
  $("bulk-confirm-no").addEventListener("click", () => { $("bulk-confirm").hidden = true; });
  $("attach-form").addEventListener("submit", (e) => volumePage.attach(e));
  $("snapshot-form").addEventListener("submit", (e) => volumePage.snapshot(e));
  $("vd-delete").addEventListener("click", () => volumePage.remove());
  window.addEventListener("hashchange", route);
  volumesPage.setupColumnChoices();
  if (storedKey()) startSession();
  else signOut();
}

wire();
