// The dashboard's one way to the control plane's REST API. The credential
// the user typed lives in sessionStorage only (this tab, until it closes
// or the user signs out): never in a URL, a cookie or localStorage, so it
// is neither sent by the browser on its own nor kept on disk.

const storageKey = 'space.dashboard.credential';

// credentialFor tells an access token (sk_e2b_..., sent as a Bearer token)
// from a team API key (sent as X-API-Key) by its prefix, as the E2B CLI
// and SDK do.
export function credentialFor(secret) {
  const value = secret.trim();
  return { kind: value.startsWith('sk_e2b_') ? 'token' : 'key', secret: value };
}

export function loadCredential() {
  try {
    const c = JSON.parse(sessionStorage.getItem(storageKey) || 'null');
    return c && typeof c.secret === 'string' && c.secret ? c : null;
  } catch {
    return null;
  }
}

export function saveCredential(c) {
  sessionStorage.setItem(storageKey, JSON.stringify(c));
}

export function clearCredential() {
  sessionStorage.removeItem(storageKey);
}

// APIError is a non-2xx answer: status and the API's own message.
export class APIError extends Error {
  constructor(status, message, body) {
    super(message);
    this.status = status;
    this.body = body;
  }

  // noRoute: the control plane has no such API (an older one), as opposed
  // to a 404 for a missing object.
  get noRoute() {
    return this.status === 404 && /no route for/i.test(this.message);
  }
}

export async function api(cred, method, path, body) {
  const headers = { Accept: 'application/json' };
  if (cred.kind === 'token') headers.Authorization = 'Bearer ' + cred.secret;
  else headers['X-API-Key'] = cred.secret;
  // An access token acts on its user's default team unless told another.
  if (cred.kind === 'token' && cred.teamID) headers['X-Team-ID'] = cred.teamID;
  const init = { method, headers, cache: 'no-store', credentials: 'omit', referrerPolicy: 'no-referrer' };
  if (body !== undefined) {
    headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  let res;
  try {
    res = await fetch(path, init);
  } catch (e) {
    throw new APIError(0, 'control plane unreachable: ' + e.message, null);
  }
  const text = await res.text();
  let data = null;
  if (text) {
    try {
      data = JSON.parse(text);
    } catch {
      data = text;
    }
  }
  if (!res.ok) {
    const msg = (data && typeof data === 'object' && data.message) || res.statusText || 'request failed';
    throw new APIError(res.status, msg, data);
  }
  return data;
}

export const sandboxes = {
  list: (c) => api(c, 'GET', '/v2/sandboxes?limit=100'),
  get: (c, id) => api(c, 'GET', '/sandboxes/' + encodeURIComponent(id)),
  executions: (c, id) => api(c, 'GET', '/space/v1/sandboxes/' + encodeURIComponent(id) + '/executions'),
  metrics: (c, id, start, end) =>
    api(c, 'GET', `/sandboxes/${encodeURIComponent(id)}/metrics?start=${start}&end=${end}`),
  logs: (c, id) => api(c, 'GET', `/v2/sandboxes/${encodeURIComponent(id)}/logs?limit=200&direction=backward`),
  pause: (c, id) => api(c, 'POST', `/sandboxes/${encodeURIComponent(id)}/pause`),
  resume: (c, id) => api(c, 'POST', `/sandboxes/${encodeURIComponent(id)}/resume`, {}),
  kill: (c, id) => api(c, 'DELETE', '/sandboxes/' + encodeURIComponent(id)),
};

export const templates = { list: (c) => api(c, 'GET', '/templates') };
export const apiKeys = { list: (c) => api(c, 'GET', '/api-keys') };
export const teams = { list: (c) => api(c, 'GET', '/teams') };
