// Team volumes with the unmodified e2b SDK: Volume.create/getInfo/connect/
// list/destroy, Sandbox.create({ volumeMounts }) with two sandboxes using
// one volume at once, the volume's quota (space up runs with
// --volume-size-mb=64, e2e_test.go), pause/resume and a cross-worker move
// keeping the mount, files outliving their sandboxes, delete refused while
// mounted. Run by e2e_test.go.
import { test, after } from 'node:test'
import assert from 'node:assert/strict'
import { randomBytes } from 'node:crypto'
import { Sandbox, Volume, VolumeError, VolumeNotFoundError, VolumePathNotFoundError, CommandExitError, AuthenticationError } from 'e2b'

const api = process.env.E2B_API_URL
const key = process.env.E2B_API_KEY
const run = randomBytes(4).toString('hex')
const created = []
const volumes = []
after(async () => {
  await Promise.all(created.map((s) => s.kill().catch(() => {})))
  await Promise.all(volumes.map((v) => Volume.destroy(v.volumeId).catch(() => {})))
})

async function create(volumeMounts, opts = {}) {
  const sbx = await Sandbox.create('base', { timeoutMs: 180_000, metadata: { run }, volumeMounts, ...opts })
  created.push(sbx)
  return sbx
}

async function migrate(id) {
  const res = await fetch(`${api}/space/v1/sandboxes/${id}/migrate`, {
    method: 'POST',
    headers: { 'X-API-Key': key, 'Content-Type': 'application/json' },
    body: '{}',
  })
  const body = await res.json()
  assert.equal(res.status, 200, JSON.stringify(body))
  return body
}

test('volumes: management API', async () => {
  const name = `vol-${run}-api`
  const vol = await Volume.create(name)
  volumes.push(vol)
  assert.match(vol.volumeId, /^vol_[0-9a-f]{24}$/)
  assert.equal(vol.name, name)
  assert.ok(vol.token && vol.token.length >= 32)
  const info = await Volume.getInfo(vol.volumeId)
  assert.deepEqual({ id: info.volumeId, name: info.name, token: info.token }, { id: vol.volumeId, name, token: vol.token })
  const again = await Volume.connect(vol.volumeId)
  assert.equal(again.name, name)
  const listed = await Volume.list()
  assert.ok(listed.some((v) => v.volumeId === vol.volumeId && v.name === name), JSON.stringify(listed))
  await assert.rejects(Volume.create(name), VolumeError) // names are unique per team
  await assert.rejects(Volume.create('bad/name'), VolumeError)
  assert.equal(await Volume.destroy(vol.volumeId), true)
  await assert.rejects(Volume.getInfo(vol.volumeId), VolumeNotFoundError)
  assert.equal(await Volume.destroy(vol.volumeId), false)
})

test('volumes: shared by two sandboxes, quota, pause/resume, move, outlives them, delete conflicts', async () => {
  const vol = await Volume.create(`vol-${run}-data`)
  volumes.push(vol)
  const a = await create({ '/mnt/data': vol })
  const b = await create({ '/home/user/shared': vol.name })
  const info = await a.getInfo()
  assert.deepEqual(info.volumeMounts, [{ name: vol.name, path: '/mnt/data' }])

  // One file system, used at the same time, writable by `user`.
  await a.files.write('/mnt/data/hello.txt', 'from a')
  assert.equal(await b.files.read('/home/user/shared/hello.txt'), 'from a')
  await b.commands.run('echo from-b >> /home/user/shared/log && id -u > /home/user/shared/who')
  assert.equal((await a.commands.run('cat /mnt/data/log /mnt/data/who')).stdout, 'from-b\n1000\n')

  // Deleting a mounted volume is a conflict.
  await assert.rejects(Volume.destroy(vol.volumeId), (e) => e instanceof VolumeError && /mounted/.test(e.message))

  // The quota (64 MiB here): ENOSPC inside.
  const fill = await a.commands
    .run('dd if=/dev/zero of=/mnt/data/fill bs=1M count=128 2>&1')
    .then((r) => r, (e) => e)
  assert.ok(fill instanceof CommandExitError, 'writing past the quota succeeded')
  assert.match(fill.stdout + fill.stderr, /No space left on device/)
  await a.commands.run('rm /mnt/data/fill')

  // Pause and resume keep the mount.
  await a.pause()
  await Sandbox.connect(a.sandboxId)
  assert.equal(await a.files.read('/mnt/data/hello.txt'), 'from a')
  // A move to the other worker mounts the volume there (same host).
  const moved = await migrate(a.sandboxId)
  assert.notEqual(moved.route.worker, moved.from.worker)
  assert.equal(await a.files.read('/mnt/data/hello.txt'), 'from a')
  await a.files.write('/mnt/data/after-move', 'moved')
  assert.equal(await b.files.read('/home/user/shared/after-move'), 'moved')
  assert.deepEqual((await a.getInfo()).volumeMounts, [{ name: vol.name, path: '/mnt/data' }])

  // Both gone: the files stay for the next sandbox.
  await a.kill()
  await b.kill()
  const c = await create({ '/data': vol })
  assert.equal(await c.files.read('/data/hello.txt'), 'from a')
  assert.equal(await c.files.read('/data/after-move'), 'moved')
  await c.kill()
  assert.equal(await Volume.destroy(vol.volumeId), true)
})

test('volumes: bad mounts are refused', async () => {
  const vol = await Volume.create(`vol-${run}-bad`)
  volumes.push(vol)
  for (const path of ['relative', '/', '/proc/x', '/dev/v', '/mnt/../etc']) {
    await assert.rejects(create({ [path]: vol }), `path ${path} accepted`)
  }
  await assert.rejects(create({ '/mnt/x': `no-such-volume-${run}` }))
})

test('volumes: content API without a sandbox (token-authorized), seen by sandboxes', async () => {
  // space up prints E2B_VOLUME_API_URL (= the API's URL); the SDK's
  // default would be https://api.<domain>.
  process.env.E2B_VOLUME_API_URL ??= api
  const vol = await Volume.create(`vol-${run}-content`)
  volumes.push(vol)
  const e = await vol.writeFile('/docs/readme.txt', 'written without a sandbox')
  assert.equal(e.type, 'file')
  assert.equal(e.size, 25)
  assert.ok(e.mtime instanceof Date)
  assert.equal(await vol.readFile('/docs/readme.txt'), 'written without a sandbox')
  assert.equal(await vol.exists('/docs/readme.txt'), true)
  assert.equal(await vol.exists('/nope'), false)
  await assert.rejects(vol.readFile('/nope'), VolumePathNotFoundError)
  const dir = await vol.makeDir('/a/b/c', { force: true })
  assert.equal(dir.type, 'directory')
  const listed = await vol.list('/', { depth: 3 })
  assert.deepEqual(listed.map((x) => x.path).sort(), ['/a', '/a/b', '/a/b/c', '/docs', '/docs/readme.txt'])
  const upd = await vol.updateMetadata('/docs/readme.txt', { mode: 0o600 })
  assert.equal(upd.mode, 0o600)

  // A sandbox sees the files (owned by `user`) and its writes come back.
  const s = await create({ '/mnt/v': vol })
  assert.equal(await s.files.read('/mnt/v/docs/readme.txt'), 'written without a sandbox')
  await s.files.write('/mnt/v/from-sandbox.txt', 'hi from inside')
  assert.equal(await vol.readFile('/from-sandbox.txt'), 'hi from inside')
  await vol.remove('/a')
  assert.equal((await s.commands.run('ls /mnt/v')).stdout.split('\n').filter(Boolean).sort().join(','), 'docs,from-sandbox.txt')

  // Another volume's token opens nothing here.
  const other = await Volume.create(`vol-${run}-other`)
  volumes.push(other)
  const forged = new Volume(vol.volumeId, vol.name, other.token, vol.domain)
  await assert.rejects(forged.readFile('/docs/readme.txt'), AuthenticationError)
})
