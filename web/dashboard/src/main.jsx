// SPACE dashboard: a single page served by the control plane at
// /dashboard/. It calls the same REST API as the SDK, with the key or
// access token the user types (see api.js for where it is kept).
import { render } from 'preact';
import { useCallback, useState } from 'preact/hooks';
import { api, teams, credentialFor, loadCredential, saveCredential, clearCredential } from './api.js';
import { useHash, usePoll } from './hooks.js';
import { SandboxList, SandboxDetail } from './sandboxes.jsx';
import { Templates, Keys } from './pages.jsx';
import './style.css';

function Login({ onLogin }) {
  const [secret, setSecret] = useState('');
  const [error, setError] = useState('');
  const [busy, setBusy] = useState(false);
  const submit = async (ev) => {
    ev.preventDefault();
    const cred = credentialFor(secret);
    if (!cred.secret) {
      setError('Type an API key (e2b_…) or an access token (sk_e2b_…).');
      return;
    }
    setBusy(true);
    setError('');
    try {
      // The list is what every key may read: it proves the key.
      await api(cred, 'GET', '/v2/sandboxes?limit=1');
      saveCredential(cred);
      onLogin(cred);
    } catch (e) {
      setError(
        e.status === 401 || e.status === 403
          ? `Sign-in refused (HTTP ${e.status}): ${e.message}`
          : `Sign-in failed${e.status ? ` (HTTP ${e.status})` : ''}: ${e.message}`,
      );
    }
    setBusy(false);
  };
  return (
    <main class="login">
      <form onSubmit={submit} data-testid="login">
        <h1>SPACE</h1>
        <label for="secret">API key or access token</label>
        <input
          id="secret"
          name="secret"
          type="password"
          autocomplete="off"
          spellcheck={false}
          placeholder="e2b_… or sk_e2b_…"
          value={secret}
          onInput={(e) => setSecret(e.currentTarget.value)}
        />
        <button type="submit" disabled={busy}>
          {busy ? 'Signing in…' : 'Sign in'}
        </button>
        {error && (
          <p class="error" role="alert" data-testid="login-error">
            {error}
          </p>
        )}
        <p class="muted small">
          Kept in this tab's session storage only, sent as <code>X-API-Key</code> (keys) or{' '}
          <code>Authorization: Bearer</code> (tokens) to this control plane.
        </p>
      </form>
    </main>
  );
}

// TeamPicker names the team the page acts on: an API key's own team, or,
// for an access token, a choice among its user's teams (sent as
// X-Team-ID). Hidden where the control plane has no /teams.
function TeamPicker({ cred, onChange }) {
  const [t] = usePoll(() => teams.list(cred), [cred.secret], 0);
  const list = Array.isArray(t.data) ? t.data : [];
  if (!list.length) return null;
  if (cred.kind !== 'token' || list.length === 1) {
    const one = list.find((x) => x.teamID === cred.teamID) || list.find((x) => x.isDefault) || list[0];
    return <span class="team" data-testid="team">team {one.name || one.teamID}</span>;
  }
  const current = cred.teamID || (list.find((x) => x.isDefault) || list[0]).teamID;
  return (
    <select class="team" data-testid="team" value={current} onChange={(e) => onChange(e.currentTarget.value)}>
      {list.map((x) => (
        <option key={x.teamID} value={x.teamID}>
          team {x.name || x.teamID}
        </option>
      ))}
    </select>
  );
}

function App() {
  const [cred, setCred] = useState(loadCredential);
  const [expired, setExpired] = useState(false);
  const hash = useHash();
  const logout = () => {
    clearCredential();
    setCred(null);
  };
  const onAuthError = useCallback((err) => {
    if (err && err.status === 401) setExpired(true);
  }, []);
  if (!cred)
    return (
      <Login
        onLogin={(c) => {
          setExpired(false);
          setCred(c);
        }}
      />
    );
  const parts = hash.split('/').filter(Boolean);
  let page;
  if (parts[0] === 'sandboxes' && parts[1]) page = <SandboxDetail cred={cred} id={decodeURIComponent(parts[1])} onAuthError={onAuthError} />;
  else if (parts[0] === 'templates') page = <Templates cred={cred} onAuthError={onAuthError} />;
  else if (parts[0] === 'keys') page = <Keys cred={cred} onAuthError={onAuthError} />;
  else page = <SandboxList cred={cred} onAuthError={onAuthError} />;
  const tab = (name, label) => (
    <a href={'#/' + name} class={parts[0] === name || (!parts[0] && name === 'sandboxes') ? 'on' : ''}>
      {label}
    </a>
  );
  return (
    <>
      <header>
        <strong>SPACE</strong>
        <nav>
          {tab('sandboxes', 'Sandboxes')}
          {tab('templates', 'Templates')}
          {tab('keys', 'API keys')}
        </nav>
        <TeamPicker
          cred={cred}
          onChange={(teamID) => {
            const c = { ...cred, teamID };
            saveCredential(c);
            setCred(c);
          }}
        />
        <span class="who mono">{cred.kind === 'token' ? 'access token' : 'API key'} …{cred.secret.slice(-4)}</span>
        <button onClick={logout} data-action="logout">
          Sign out
        </button>
      </header>
      {expired && (
        <p class="error banner" role="alert">
          The control plane refused the credential (401): sign out and in again.
        </p>
      )}
      <main>{page}</main>
    </>
  );
}

render(<App />, document.getElementById('app'));
