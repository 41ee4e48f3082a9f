// Builds the dashboard into internal/dashboard/assets, which the control
// plane embeds (go:embed): index.html, app.js, app.css and sources.sha256,
// the hash of every source file (internal/dashboard's test recomputes it,
// so a committed bundle older than its sources fails the tests).
// Run through `make dashboard`.
import * as esbuild from 'esbuild';
import { createHash } from 'node:crypto';
import { copyFileSync, mkdirSync, readdirSync, readFileSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { join, relative, sep } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = fileURLToPath(new URL('.', import.meta.url));
const out = join(here, '..', '..', 'internal', 'dashboard', 'assets');

// sourcesHash must match internal/dashboard's sourcesHash: the sorted
// slash paths of package.json, package-lock.json, build.mjs and src/**,
// each as "path\0sha256hex(content)\n", hashed with SHA-256.
function sourcesHash() {
  const files = ['package.json', 'package-lock.json', 'build.mjs'];
  const walk = (dir) => {
    for (const name of readdirSync(join(here, dir))) {
      const rel = dir + '/' + name;
      if (statSync(join(here, rel)).isDirectory()) walk(rel);
      else files.push(rel);
    }
  };
  walk('src');
  files.sort();
  const h = createHash('sha256');
  for (const f of files) {
    const sum = createHash('sha256').update(readFileSync(join(here, f))).digest('hex');
    h.update(f.split(sep).join('/') + '\0' + sum + '\n');
  }
  return h.digest('hex');
}

rmSync(out, { recursive: true, force: true });
mkdirSync(out, { recursive: true });
await esbuild.build({
  absWorkingDir: here,
  entryPoints: { app: 'src/main.jsx' },
  bundle: true,
  minify: true,
  format: 'esm',
  target: ['es2020', 'chrome100', 'firefox100', 'safari15'],
  jsx: 'automatic',
  jsxImportSource: 'preact',
  outdir: out,
  logLevel: 'warning',
});
copyFileSync(join(here, 'src', 'index.html'), join(out, 'index.html'));
writeFileSync(join(out, 'sources.sha256'), sourcesHash() + '\n');
for (const f of readdirSync(out)) console.log(relative(join(here, '..', '..'), join(out, f)), statSync(join(out, f)).size);
