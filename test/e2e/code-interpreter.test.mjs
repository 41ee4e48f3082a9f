// The code interpreter with the unmodified @e2b/code-interpreter package:
// Sandbox.create() with no template gets code-interpreter-v1 (the SDK's
// default) and runCode reaches the server on port 49999 through the edge
// (E2B_SANDBOX_URL). State between calls, streaming callbacks, errors with
// tracebacks, rich results (a DataFrame's HTML, a matplotlib PNG with its
// chart data), contexts in Python and JavaScript (Deno's kernel), a timeout
// that interrupts the kernel, env vars, cwd, pause/resume; and the microVM
// variant, whose template snapshot holds a warm kernel. Run by
// e2e_test.go.
import { test, after, before } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox, Template } from '@e2b/code-interpreter'

for (const v of ['E2B_API_URL', 'E2B_SANDBOX_URL', 'E2B_API_KEY']) {
  if (!process.env[v]) throw new Error(`${v} must be set (run through go test ./test/e2e)`)
}

const created = []
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
})

async function create(template, opts = {}) {
  const t0 = performance.now()
  const sbx = template
    ? await Sandbox.create(template, { timeoutMs: 300_000, ...opts })
    : await Sandbox.create({ timeoutMs: 300_000, ...opts })
  created.push(sbx)
  return { sbx, ms: performance.now() - t0 }
}

// A string result's text: with or without Python's repr quotes (the
// server may give either for a str).
const unq = (t) => (typeof t === 'string' ? t.replace(/^'(.*)'$/s, '$1') : t)
// A traceback without its ANSI colours (Jupyter's tracebacks carry them).
const plain = (t) => t.replace(/\x1b\[[0-9;]*m/g, '')

let sbx
before(async () => {
  ;({ sbx } = await create(undefined, { envs: { SBX_LEVEL: 'from-create' } }))
})

test('the SDK default template is code-interpreter-v1 and its server is ready at create', async () => {
  const info = await sbx.getInfo()
  assert.equal(info.templateId, 'code-interpreter-v1')
  // The server runs as user in /home/user.
  const r = await sbx.runCode('import os, getpass\n(getpass.getuser(), os.getcwd())')
  assert.equal(r.error, undefined, JSON.stringify(r.error))
  assert.equal(r.text, "('user', '/home/user')")
})

test('state is kept between runCode calls; execution counts grow', async () => {
  const a = await sbx.runCode('x = 1')
  const b = await sbx.runCode('x += 1; x')
  assert.equal(b.text, '2')
  assert.equal(b.results[0].isMainResult, true)
  assert.ok(b.executionCount > a.executionCount, `${a.executionCount} then ${b.executionCount}`)
})

test('streaming callbacks get stdout, stderr and results as they come', async () => {
  const seen = []
  let firstOut
  const t0 = performance.now()
  const r = await sbx.runCode(
    'import sys, time\nfor i in range(3):\n    print("line", i, flush=True)\n    time.sleep(0.4)\nprint("oops", file=sys.stderr, flush=True)\n40 + 2',
    {
      onStdout: (m) => {
        firstOut ??= performance.now() - t0
        seen.push(['out', m.line])
      },
      onStderr: (m) => seen.push(['err', m.line]),
      onResult: (res) => seen.push(['result', res.text]),
    },
  )
  const total = performance.now() - t0
  assert.deepEqual(seen.filter(([k]) => k === 'out').map(([, l]) => l.trim()), ['line 0', 'line 1', 'line 2'])
  assert.ok(seen.some(([k, l]) => k === 'err' && l.includes('oops')), JSON.stringify(seen))
  assert.deepEqual(seen.at(-1), ['result', '42'])
  assert.ok(total - firstOut > 600, `the first line came ${firstOut} ms in, the end ${total} ms: not streamed`)
  assert.deepEqual(r.logs.stdout.map((l) => l.trim()), ['line 0', 'line 1', 'line 2'])
  assert.match(r.logs.stderr.join(''), /oops/)
})

test("an exception's name, value and traceback", async () => {
  await sbx.runCode('before_error = 3')
  const r = await sbx.runCode('def inner():\n    raise ValueError("boom")\n\ninner()')
  assert.ok(r.error, 'no error')
  assert.equal(r.error.name, 'ValueError')
  assert.equal(r.error.value, 'boom')
  assert.match(plain(r.error.traceback), /inner\(\)/)
  assert.match(plain(r.error.traceback), /ValueError: boom/)
  // The context goes on.
  assert.equal((await sbx.runCode('before_error')).text, '3')
})

test('a pandas DataFrame as HTML and text', async () => {
  const r = await sbx.runCode('import pandas as pd\npd.DataFrame({"name": ["a", "b"], "value": [1, 2]})')
  assert.equal(r.error, undefined, JSON.stringify(r.error))
  const res = r.results[0]
  assert.match(res.html, /<table/)
  assert.match(res.html, /<th>value<\/th>/)
  assert.match(res.text, /name\s+value/)
  assert.ok(res.formats().includes('html'), res.formats().join(','))
})

test('a matplotlib figure: its PNG and its chart data', async () => {
  const r = await sbx.runCode(`
import matplotlib.pyplot as plt
plt.figure()
plt.plot([1, 2, 3], [2, 4, 8], label="growth")
plt.title("Growth")
plt.xlabel("step")
plt.ylabel("size")
plt.show()
`)
  assert.equal(r.error, undefined, JSON.stringify(r.error))
  const res = r.results.find((x) => x.png)
  assert.ok(res, `no png among ${r.results.map((x) => x.formats().join('+')).join(', ')}`)
  assert.equal(Buffer.from(res.png, 'base64').subarray(1, 4).toString(), 'PNG')
  assert.ok(res.chart, 'no chart data')
  assert.equal(res.chart.type, 'line')
  assert.equal(res.chart.title, 'Growth')
  assert.equal(res.chart.x_label, 'step')
  assert.equal(res.chart.y_label, 'size')
  assert.equal(res.chart.elements.length, 1)
  assert.equal(res.chart.elements[0].label, 'growth')
  assert.deepEqual(res.chart.elements[0].points.map(([, y]) => Number(y)), [2, 4, 8])

  const bars = await sbx.runCode(`
import matplotlib.pyplot as plt
plt.figure()
plt.bar(["a", "b", "c"], [3, 1, 2])
plt.title("Bars")
plt.show()
`)
  const chart = bars.results.find((x) => x.chart)?.chart
  assert.ok(chart, 'no bar chart data')
  assert.equal(chart.type, 'bar')
  assert.deepEqual(chart.elements.map((e) => [e.label, Number(e.value)]), [['a', 3], ['b', 1], ['c', 2]])
})

test('contexts in two languages: Python and JavaScript (Deno)', async () => {
  const py = await sbx.createCodeContext({ language: 'python' })
  const js = await sbx.createCodeContext({ language: 'js' })
  assert.equal(py.language, 'python')
  assert.ok(js.id && js.id !== py.id)

  await sbx.runCode('v = 20', { context: py })
  assert.equal((await sbx.runCode('v * 2 + 2', { context: py })).text, '42')
  // Contexts are separate: x of the default context is not here.
  assert.equal((await sbx.runCode('x', { context: py })).error?.name, 'NameError')

  await sbx.runCode('const a = 40', { context: js })
  const r = await sbx.runCode('a + 2', { context: js })
  assert.equal(r.error, undefined, JSON.stringify(r.error))
  assert.equal(r.text, '42')
  const out = await sbx.runCode('console.log("from deno")', { context: js })
  assert.match(out.logs.stdout.join(''), /from deno/)
  // A language without a context of its own: its default context.
  assert.equal((await sbx.runCode('[1, 2, 3].length', { language: 'javascript' })).text, '3')

  const listed = await sbx.listCodeContexts()
  for (const c of [py, js]) assert.ok(listed.some((l) => l.id === c.id), `${c.id} not listed`)

  await sbx.restartCodeContext(py)
  assert.equal((await sbx.runCode('v', { context: py })).error?.name, 'NameError', 'a restart keeps state')
  await sbx.removeCodeContext(js)
  assert.ok(!(await sbx.listCodeContexts()).some((l) => l.id === js.id), 'a removed context is still listed')
  await assert.rejects(sbx.runCode('1', { context: js }))
  // The SDK reports a 400 by its status only (extractError).
  await assert.rejects(sbx.runCode('1', { language: 'cobol' }), /400/)
})

test('a timeout interrupts `while True: pass` and the context stays usable', async () => {
  const ctx = await sbx.createCodeContext()
  await sbx.runCode('kept = "still here"', { context: ctx })
  const t0 = performance.now()
  await assert.rejects(sbx.runCode('while True: pass', { context: ctx, timeoutMs: 2_000 }), (e) => /timeout|abort/i.test(`${e.name} ${e.message}`))
  assert.ok(performance.now() - t0 < 10_000)
  const t1 = performance.now()
  const r = await sbx.runCode('kept', { context: ctx, timeoutMs: 30_000 })
  assert.equal(unq(r.text), 'still here')
  assert.ok(performance.now() - t1 < 10_000, `the next run waited ${performance.now() - t1} ms: the loop was not interrupted`)
})

test('env vars: per execution, and the sandbox envs of the create', async () => {
  const code = 'import os\nos.environ.get("PER_RUN")'
  assert.equal(unq((await sbx.runCode(code, { envs: { PER_RUN: 'yes' } })).text), 'yes')
  assert.equal((await sbx.runCode(code)).text, undefined, 'an execution env var outlived its execution')
  assert.equal(unq((await sbx.runCode('import os\nos.environ["SBX_LEVEL"]')).text), 'from-create')
  // Also for JavaScript.
  const r = await sbx.runCode('Deno.env.get("PER_RUN")', { language: 'js', envs: { PER_RUN: 'js-too' } })
  assert.match(r.text ?? '', /js-too/)
})

test('cwd: per context, default /home/user', async () => {
  await sbx.files.write('/tmp/here/data.txt', 'found')
  const ctx = await sbx.createCodeContext({ cwd: '/tmp/here' })
  assert.equal(ctx.cwd, '/tmp/here')
  assert.equal(unq((await sbx.runCode('open("data.txt").read()', { context: ctx })).text), 'found')
  assert.equal(unq((await sbx.runCode('import os\nos.getcwd()')).text), '/home/user')
})

test('contexts survive pause and resume', async () => {
  const { sbx: s } = await create('code-interpreter-v1')
  const ctx = await s.createCodeContext()
  await s.runCode('kept = [1, 2, 3]', { context: ctx })
  await s.runCode('top = "default"')
  assert.equal(await s.pause(), true)
  const back = await Sandbox.connect(s.sandboxId)
  assert.equal((await back.runCode('sum(kept)', { context: ctx })).text, '6')
  assert.equal(unq((await back.runCode('top')).text), 'default')
})

test('after a move on ns the contexts report that their kernels restarted', async () => {
  const { sbx: s } = await create('code-interpreter-v1')
  await s.runCode('before_move = 1')
  const ctx = await s.createCodeContext({ language: 'python' })
  await s.runCode('in_ctx = 2', { context: ctx })
  const res = await fetch(`${process.env.E2B_API_URL}/space/v1/sandboxes/${s.sandboxId}/migrate`, {
    method: 'POST',
    headers: { 'X-API-Key': process.env.E2B_API_KEY, 'Content-Type': 'application/json' },
    body: '{}',
  })
  assert.equal(res.status, 200, await res.text())
  // ns moves restart processes: the platform started the server again
  // before the move was answered, on the contexts kept in the sandbox's
  // files. Each context is still listed and says once that its kernel
  // restarted (that code does not run); then it runs code again, without
  // the old kernel's state.
  assert.ok((await s.listCodeContexts()).some((c) => c.id === ctx.id), 'the context is not listed after the move')
  for (const opts of [{}, { context: ctx }]) {
    const first = await s.runCode('1 + 1', opts)
    assert.equal(first.error?.name, 'KernelRestarted', JSON.stringify(first))
    assert.equal(first.results.length, 0)
    assert.equal((await s.runCode('1 + 1', opts)).text, '2')
  }
  assert.equal((await s.runCode('before_move')).error?.name, 'NameError')
  assert.equal((await s.runCode('in_ctx', { context: ctx })).error?.name, 'NameError')
})

test('a team template built from code-interpreter-v1 keeps its server', async () => {
  // E2B's way to add packages to the code interpreter: a template on top.
  const name = `ci-derived-${randomBytes(4).toString('hex')}`
  await Template.build(Template().fromTemplate('code-interpreter-v1').runCmd('echo from-the-template > /home/user/marker.txt'), name)
  const { sbx: s } = await create(name)
  const r = await s.runCode('open("/home/user/marker.txt").read().strip()')
  assert.equal(r.error, undefined, JSON.stringify(r.error))
  assert.equal(unq(r.text), 'from-the-template')
})

test('microVM: code-interpreter-v1-vm, created from a snapshot with a warm kernel', async (t) => {
  // Run by TestCodeInterpreterMicroVM (codeinterp_test.go), which skips
  // through testenv without a guest kernel and checks this one ran.
  if (!process.env.SPACE_TEST_CODEINTERP_VM) {
    t.skip('run by TestCodeInterpreterMicroVM (SPACE_TEST_CODEINTERP_VM)')
    return
  }
  // The team's first create takes the warm snapshot (a VM boot, the
  // server's start, a snapshot): more than the SDK's default 60 s request
  // timeout under TCG.
  const vmOpts = { requestTimeoutMs: 600_000 }
  const first = await create('code-interpreter-v1-vm', vmOpts)
  const r = await first.sbx.runCode('import platform\nplatform.release()')
  assert.match(r.text, /cloud/, 'not a microVM kernel')
  // A second create restores the team's warm snapshot: the first runCode
  // finds the kernel running (a kernel start is seconds).
  const { sbx: s, ms } = await create('code-interpreter-v1-vm', vmOpts)
  const t0 = performance.now()
  const one = await s.runCode('1 + 1')
  const firstRun = performance.now() - t0
  assert.equal(one.text, '2')
  t.diagnostic(`create ${ms.toFixed(0)} ms, first runCode ${firstRun.toFixed(0)} ms`)
  assert.ok(firstRun < 1_500, `the first runCode took ${firstRun} ms: the kernel was not warm`)
  // Contexts survive pause/resume here too (the VM's memory).
  await s.runCode('vm_state = 41')
  assert.equal(await s.pause(), true)
  const back = await Sandbox.connect(s.sandboxId)
  assert.equal((await back.runCode('vm_state + 1')).text, '42')
})
