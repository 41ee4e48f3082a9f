// e2b SDK compatibility: template builds (Template.build with fromTemplate,
// runCmd, copy, setEnvs, setStartCmd + waitForPort), aliases and tags,
// Template.exists, the build cache and a failing step's report.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import http from 'node:http'
import fs from 'node:fs'
import os from 'node:os'
import path from 'node:path'
import { randomBytes } from 'node:crypto'
import { Sandbox, Template, waitForPort, BuildError } from 'e2b'

const run = randomBytes(4).toString('hex')
const created = []
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

function getVia(edge, host, p) {
  return new Promise((resolve, reject) => {
    const req = http.request({ host: edge.hostname, port: edge.port, path: p, headers: { Host: host } }, (res) => {
      let text = ''
      res.setEncoding('utf8')
      res.on('data', (c) => (text += c))
      res.on('end', () => resolve({ status: res.statusCode, text }))
    })
    req.on('error', reject)
    req.end()
  })
}

const ctxDir = fs.mkdtempSync(path.join(os.tmpdir(), 'space-tpl-'))
fs.writeFileSync(path.join(ctxDir, 'index.html'), `built by ${run}\n`)
fs.mkdirSync(path.join(ctxDir, 'conf'))
fs.writeFileSync(path.join(ctxDir, 'conf', 'app.conf'), 'mode=test\n')

function template() {
  return Template({ fileContextPath: ctxDir })
    .fromTemplate('base')
    .runCmd('mkdir -p /srv/www && echo step-ran > /srv/www/ran.txt')
    .copy('index.html', '/srv/www/')
    .copy('conf', '/etc/myapp')
    .setEnvs({ APP_MODE: 'templated', RUN_ID: run })
    .setStartCmd('cd /srv/www && python3 -m http.server 8000', waitForPort(8000))
}

test('Template.exists sees the platform templates', async () => {
  assert.equal(await Template.exists('base'), true)
  assert.equal(await Template.exists(`nope-${run}`), false)
})

test('build a template, start a sandbox from it, rebuild from cache', async () => {
  const name = `web-${run}`
  const logs = []
  const t0 = Date.now()
  const info = await Template.build(template(), name, { onBuildLogs: (l) => logs.push(String(l.message ?? l)) })
  const cold = Date.now() - t0
  assert.equal(info.name, name)
  assert.ok(info.templateId && info.buildId)
  assert.equal(await Template.exists(name), true)

  const sbx = await Sandbox.create(name, { timeoutMs: 120_000 })
  created.push(sbx)
  // The start command is up before create returns: the first request answers.
  const edge = new URL(process.env.E2B_SANDBOX_URL)
  const res = await getVia(edge, sbx.getHost(8000), '/index.html')
  assert.equal(res.status, 200)
  assert.equal(res.text, `built by ${run}\n`)
  assert.equal((await sbx.files.read('/srv/www/ran.txt')).trim(), 'step-ran')
  assert.equal((await sbx.files.read('/etc/myapp/app.conf')).trim(), 'mode=test')
  const env = await sbx.commands.run('echo "$APP_MODE $RUN_ID"')
  assert.equal(env.stdout.trim(), `templated ${run}`)

  // The same template again: every step from the cache.
  const t1 = Date.now()
  const logs2 = []
  await Template.build(template(), name, { onBuildLogs: (l) => logs2.push(String(l.message ?? l)) })
  const cached = Date.now() - t1
  assert.ok(logs2.some((l) => l.includes('CACHED')), `no cached step in: ${logs2.join('\n')}`)
  console.log(`template build: cold ${cold} ms, cached ${cached} ms`)

  // skipCache runs the steps again.
  const logs3 = []
  await Template.build(template(), name, { skipCache: true, onBuildLogs: (l) => logs3.push(String(l.message ?? l)) })
  assert.ok(!logs3.some((l) => l.includes('CACHED')), 'skipCache served a cached step')
})

test('a failing step reports its output and exit code', async () => {
  const t = Template().fromTemplate('base').runCmd('echo about-to-fail && exit 7')
  await assert.rejects(Template.build(t, `fail-${run}`), (e) => {
    assert.ok(e instanceof BuildError, `${e}`)
    assert.match(e.message, /exited with 7/)
    return true
  })
})

test('another template name from a built one, and bad names', async () => {
  await assert.rejects(Template.build(Template().fromTemplate('base').runCmd('true'), 'Bad Name!'))
  await assert.rejects(Template.build(Template().fromTemplate('base').runCmd('true'), 'base'))
})

test('a build step reaches the network under the operator policy', async () => {
  const inet = JSON.parse(process.env.SPACE_TEST_INET ?? 'null')
  if (!inet) return // only through go test ./test/e2e
  const [h0] = inet.hosts
  const t = Template().fromTemplate('base').runCmd(`curl -sS --max-time 10 http://${h0}/ -o /tmp/fetched && test -s /tmp/fetched`)
  await Template.build(t, `net-${run}`).catch((e) => { throw new Error(`build with the network: ${e.message}`) })
  // The metadata endpoint stays out of reach, whatever a build asks.
  const bad = Template().fromTemplate('base').runCmd('curl -sS --max-time 3 http://169.254.169.254/')
  await assert.rejects(Template.build(bad, `meta-${run}`), BuildError)
})
