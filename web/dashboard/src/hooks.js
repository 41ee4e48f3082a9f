import { useCallback, useEffect, useRef, useState } from 'preact/hooks';

// usePoll calls load now and every `every` ms while the component lives;
// reload calls it at once (after an action). A failed call keeps the last
// data and reports the error.
export function usePoll(load, deps, every) {
  const [state, setState] = useState({ data: null, error: null, loaded: false });
  const gen = useRef(0);
  const run = useCallback(async () => {
    const mine = ++gen.current;
    try {
      const data = await load();
      if (mine === gen.current) setState({ data, error: null, loaded: true });
    } catch (error) {
      if (mine === gen.current) setState((s) => ({ data: s.data, error, loaded: true }));
    }
  }, deps);
  useEffect(() => {
    run();
    if (!every) return undefined;
    const t = setInterval(run, every);
    return () => {
      clearInterval(t);
      gen.current++;
    };
  }, [run, every]);
  return [state, run];
}

// useHash is the page's route: location.hash without the '#'.
export function useHash() {
  const [hash, setHash] = useState(location.hash.slice(1) || '/sandboxes');
  useEffect(() => {
    const on = () => setHash(location.hash.slice(1) || '/sandboxes');
    addEventListener('hashchange', on);
    return () => removeEventListener('hashchange', on);
  }, []);
  return hash;
}

export function ago(t) {
  if (!t) return '—';
  const d = new Date(t);
  if (isNaN(d)) return '—';
  const s = Math.round((Date.now() - d.getTime()) / 1000);
  if (s < 0) return 'in ' + dur(-s);
  return dur(s) + ' ago';
}

function dur(s) {
  if (s < 60) return s + 's';
  if (s < 3600) return Math.floor(s / 60) + 'm';
  if (s < 86400) return Math.floor(s / 3600) + 'h';
  return Math.floor(s / 86400) + 'd';
}

export function bytes(n) {
  if (n === null || n === undefined) return '—';
  const u = ['B', 'KiB', 'MiB', 'GiB', 'TiB'];
  let i = 0;
  while (n >= 1024 && i < u.length - 1) {
    n /= 1024;
    i++;
  }
  return (i ? n.toFixed(1) : n) + ' ' + u[i];
}
