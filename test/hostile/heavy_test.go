package hostile

// Heavy attacks: each loads the host (CPU, memory, disk, kernel-wide
// tables, connections), so they run one at a time, before the probes.

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/testenv"
	"github.com/spacesbx/space/sdk"
)

// Finding 2: unauthenticated uploads that announce 16 MiB and stall.
func TestEdgeStalledUploads(t *testing.T) {
	p := shared(t)
	s := p.sandbox(t, true)
	const conns = 1000
	base, _ := vmRSS(p.pid)
	var mu sync.Mutex
	var open []net.Conn
	defer func() {
		mu.Lock()
		for _, c := range open {
			c.Close()
		}
		mu.Unlock()
	}()
	chunk := make([]byte, 64<<10)
	var wg sync.WaitGroup
	var dialErrs int
	for i := 0; i < conns; i++ {
		wg.Add(1)
		go func(i int) {
			defer wg.Done()
			c, err := net.DialTimeout("tcp", p.edge, 10*time.Second)
			if err != nil {
				mu.Lock()
				dialErrs++
				mu.Unlock()
				return
			}
			mu.Lock()
			open = append(open, c)
			mu.Unlock()
			id, token := "nosuchsandbox"+randHex(6), "wrong"
			if i%2 == 1 { // a real sandbox, a wrong token
				id, token = s.ID, "0000"+randHex(30)
			}
			c.SetWriteDeadline(time.Now().Add(5 * time.Second))
			fmt.Fprintf(c, "POST /files?path=/home/user/up%d HTTP/1.1\r\nHost: %s\r\nE2b-Sandbox-Id: %s\r\nE2b-Sandbox-Port: 49983\r\n"+
				"X-Access-Token: %s\r\nContent-Type: application/octet-stream\r\nContent-Length: %d\r\n\r\n", i, p.edge, id, token, 16<<20)
			c.Write(chunk) // a little of the body, then nothing
		}(i)
		if i%100 == 99 {
			wg.Wait()
		}
	}
	wg.Wait()
	if dialErrs > 0 {
		t.Errorf("%d of %d connections to the edge failed", dialErrs, conns)
	}
	// Hold them stalled while a normal client works and space up's
	// memory is sampled.
	var peak int64
	end := time.Now().Add(8 * time.Second)
	for time.Now().Before(end) {
		if rss, err := vmRSS(p.pid); err == nil && rss > peak {
			peak = rss
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		_, err := p.client.ListSandboxes(ctx)
		cancel()
		if err != nil {
			t.Errorf("a normal control-plane call failed during the stall: %v", err)
		}
		if d := s.alive(t, 10*time.Second); d > 5*time.Second {
			t.Errorf("a normal command took %v during the stall", d)
		}
		ctx, cancel = context.WithTimeout(context.Background(), 10*time.Second)
		if _, err := s.ReadFile(ctx, "/etc/hostname"); err != nil {
			t.Errorf("a normal file read failed during the stall: %v", err)
		}
		cancel()
	}
	t.Logf("space up VmRSS: %d MiB before, peak %d MiB with %d stalled 16 MiB uploads", base/mib, peak/mib, conns)
	if peak > 300*mib {
		t.Errorf("space up's RSS reached %d MiB with %d stalled unauthenticated uploads (limit 300 MiB)", peak/mib, conns)
	}
}

// Finding 3: a sparse file in a snapshot.
func TestSparseSnapshot(t *testing.T) {
	p := shared(t)
	s := p.sandbox(t, false)
	s.mustSh(t, "user", "truncate -s 2G /home/user/sparse && dd if=/dev/urandom of=/home/user/sparse bs=1M count=200 seek=512 conv=notrunc status=none")
	sum := s.mustSh(t, "user", "dd if=/home/user/sparse bs=1M skip=512 count=200 status=none | sha256sum")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var snap struct {
		SnapshotID string `json:"snapshotID"`
	}
	if _, err := p.rest(ctx, "POST", "/sandboxes/"+s.ID+"/snapshots", map[string]any{}, &snap); err != nil {
		t.Fatalf("snapshot: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		p.rest(ctx, "DELETE", "/templates/"+snap.SnapshotID, nil, nil)
	})
	archive := filepath.Join(p.dataDir, "snapshots", snap.SnapshotID)
	fi, err := os.Stat(archive)
	if err != nil {
		t.Fatalf("the snapshot archive: %v", err)
	}
	t.Logf("snapshot archive %s: %d MiB", archive, fi.Size()/mib)
	if fi.Size() > 250*mib {
		t.Errorf("the snapshot archive of 200 MiB of data in a 2 GiB sparse file is %d MiB (limit 250 MiB)", fi.Size()/mib)
	}
	// Restore: a sandbox from the snapshot.
	r, err := p.client.CreateSandbox(ctx, sdk.CreateOptions{Template: snap.SnapshotID, Timeout: 5 * time.Minute})
	if err != nil {
		t.Fatalf("create from the snapshot: %v", err)
	}
	t.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		r.Kill(ctx)
	})
	restored := &sandbox{r, p}
	if got := restored.mustSh(t, "user", "stat -c %s /home/user/sparse; dd if=/home/user/sparse bs=1M skip=512 count=200 status=none | sha256sum"); got != "2147483648\n"+sum {
		t.Errorf("restored file: %q, want size 2147483648 and %q", got, sum)
	}
	if a := restored.allocated(t, "/home/user/sparse"); a > 250*mib {
		t.Errorf("the restored file takes %d MiB on disk for 200 MiB of data (not sparse; limit 250 MiB)", a/mib)
	}
	if upper := restored.upperDir(t); upper != "" {
		du, err := duBytes(upper)
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("restored writable layer %s: du %d MiB", upper, du/mib)
		if du > 250*mib {
			t.Errorf("the restored writable layer takes %d MiB on disk for 200 MiB of data (not sparse; limit 250 MiB)", du/mib)
		}
	}
}

// metricsDisk is the sandbox's diskUsed now.
func (p *platform) metricsDisk(ctx context.Context, id string) (int64, error) {
	var m []struct {
		DiskUsed int64 `json:"diskUsed"`
	}
	if _, err := p.rest(ctx, "GET", "/sandboxes/"+id+"/metrics", nil, &m); err != nil {
		return 0, err
	}
	if len(m) == 0 {
		return 0, errors.New("no metrics sample")
	}
	return m[0].DiskUsed, nil
}

// Finding 4: the host's disk accounting follows a symlink the sandbox
// swaps in for a directory (renameat2 RENAME_EXCHANGE).
func TestMetricsSymlinkSwap(t *testing.T) {
	p := shared(t)
	s := p.sandbox(t, false)
	s.upload(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	base, err := p.metricsDisk(ctx, s.ID)
	if err != nil {
		t.Fatal(err)
	}
	out, done := s.start(ctx, "user", "/tmp/attack", "swap", "/home/user/swap", "12s")
	if !out.waitFor("swapping", 10*time.Second) {
		t.Fatalf("the swap attack did not start: %q", out.String())
	}
	// The sandbox wrote 128 KiB of files and 8 symlinks; 2 MiB of slack
	// (directories, if an accounting counts them).
	limit := base + 128<<10 + 2*mib
	var peak int64
	samples, errs := 0, 0
	end := time.Now().Add(8 * time.Second)
	for time.Now().Before(end) {
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		d, err := p.metricsDisk(rctx, s.ID)
		rcancel()
		if err != nil {
			errs++
			continue
		}
		samples++
		peak = max(peak, d)
	}
	r := <-done
	t.Logf("diskUsed: %d KiB before, peak %d KiB over %d samples (%d errors); attack: %s", base>>10, peak>>10, samples, errs, strings.TrimSpace(r.out))
	if !strings.Contains(r.out, "RENAME_EXCHANGE: ok") {
		t.Fatalf("the swap attack did not run: %s", r.out)
	}
	if samples == 0 {
		t.Fatalf("no metrics sample during the attack (%d errors)", errs)
	}
	if peak > limit {
		t.Errorf("diskUsed reached %d KiB while the sandbox wrote 128 KiB over a %d KiB base (limit %d KiB): the host walked through the sandbox's symlinks",
			peak>>10, base>>10, limit>>10)
	}
}

// Finding 5a: one sandbox takes every pseudo-terminal it can.
func TestPTYFlood(t *testing.T) {
	p := shared(t)
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	a.upload(t)
	ptyMax, _ := strconv.Atoi(readTrim("/proc/sys/kernel/pty/max"))
	ctx, cancel := context.WithTimeout(context.Background(), 90*time.Second)
	defer cancel()
	out, done := a.start(ctx, "user", "/tmp/attack", "ptmx", strconv.Itoa(max(ptyMax, 4096)), "60s")
	if !out.waitFor("holding", 60*time.Second) {
		t.Fatalf("the pty flood did not finish opening: %q", out.String())
	}
	var n int
	var last string
	for _, l := range strings.Split(out.String(), "\n") {
		if strings.HasPrefix(l, "ptys: ") {
			fmt.Sscanf(l, "ptys: %d %s", &n, &last)
		}
	}
	t.Logf("sandbox a holds %d ptys (stopped by %s); kernel.pty.max %d, in use on the host now %s", n, last, ptyMax, readTrim("/proc/sys/kernel/pty/nr"))
	// Another sandbox still gets a terminal.
	pctx, pcancel := context.WithTimeout(ctx, 20*time.Second)
	term, err := b.PTY(pctx, 24, 80, sdk.PTYOptions{Cmd: "/bin/bash", Args: []string{"-c", "echo pty-ok"}})
	if err != nil {
		t.Errorf("sandbox b could not get a pty while a holds %d: %v", n, err)
	} else {
		var got strings.Builder
		buf := make([]byte, 256)
		for {
			k, err := term.Read(buf)
			got.Write(buf[:k])
			if err != nil {
				break
			}
		}
		term.Close()
		if !strings.Contains(got.String(), "pty-ok") {
			t.Errorf("sandbox b's pty: %q", got.String())
		}
	}
	pcancel()
	if ptyMax > 0 && n > ptyMax/4 {
		t.Errorf("one sandbox took %d ptys: not capped well below kernel.pty.max %d (allowed %d)", n, ptyMax, ptyMax/4)
	}
	a.Kill(context.Background())
	cancel()
	<-done
}

// Finding 5b: one sandbox's user takes every inotify instance.
func TestInotifyFlood(t *testing.T) {
	p := shared(t)
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	a.upload(t)
	b.upload(t)
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	out, done := a.start(ctx, "user", "/tmp/attack", "inotify", "100000", "30s")
	if !out.waitFor("holding", 30*time.Second) {
		t.Fatalf("the inotify flood did not finish: %q", out.String())
	}
	t.Logf("sandbox a: %s", strings.TrimSpace(out.String()))
	r := b.attack(t, "user", "inotify", "1", "0s")
	if !strings.Contains(r.out, "inotify: 1 none") {
		t.Errorf("sandbox b's user cannot inotify_init while sandbox a holds its instances: %s", strings.TrimSpace(r.out))
	}
	a.Kill(context.Background())
	cancel()
	<-done
}

// Fork bomb: the platform and other sandboxes stay responsive.
func TestForkBomb(t *testing.T) {
	p := shared(t)
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	agent := agentPid(t, a.ID)
	ctx, cancel := context.WithTimeout(context.Background(), 40*time.Second)
	defer cancel()
	_, done := a.start(ctx, "user", "/bin/bash", "-c", "bomb() { bomb | bomb & }; bomb; sleep 30")
	time.Sleep(3 * time.Second)
	for i := 0; i < 5; i++ {
		if d := b.alive(t, 15*time.Second); d > 5*time.Second {
			t.Errorf("another sandbox's command took %v during a fork bomb", d)
		}
		lctx, lcancel := context.WithTimeout(ctx, 10*time.Second)
		if _, err := p.client.ListSandboxes(lctx); err != nil {
			t.Errorf("the control plane failed during a fork bomb: %v", err)
		}
		lcancel()
		time.Sleep(time.Second)
	}
	// The bombed sandbox's own agent still answers (its pids reserve).
	// The command itself may be refused: its group is full.
	t0 := time.Now()
	r := a.exec(t, 20*time.Second, "user", "/bin/echo", "alive")
	t.Logf("a command in the bombed sandbox: exit %d, %v, %q after %v", r.code, r.err, r.out, time.Since(t0).Round(time.Millisecond))
	if d := time.Since(t0); d > 10*time.Second || errors.Is(r.err, context.DeadlineExceeded) {
		t.Errorf("the bombed sandbox's agent did not answer within 10s (%v): %v", d, r.err)
	}
	if _, err := os.Stat(fmt.Sprintf("/proc/%d", agent)); err != nil {
		t.Errorf("the bombed sandbox's agent died")
	}
	kctx, kcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer kcancel()
	t0 = time.Now()
	if err := a.Kill(kctx); err != nil {
		t.Errorf("killing the bombed sandbox: %v", err)
	}
	t.Logf("killed the bombed sandbox in %v", time.Since(t0).Round(time.Millisecond))
	cancel()
	<-done
	b.alive(t, 10*time.Second)
}

// Memory hog: OOM-killed in its own cgroup; the agent and others survive.
func TestMemoryHog(t *testing.T) {
	p := shared(t)
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	a.upload(t)
	agent := agentPid(t, a.ID)
	r := a.exec(t, 60*time.Second, "user", "/tmp/attack", "memhog", "64", "8192")
	tail := r.out
	if i := strings.LastIndex(tail, "allocated"); i >= 0 {
		tail = tail[i:]
	}
	t.Logf("memory hog: exit %d, %v, last: %s", r.code, r.err, strings.TrimSpace(tail))
	var pe *sdk.ProcessError
	switch {
	case strings.Contains(r.out, "memhog: not stopped"):
		t.Errorf("the memory hog allocated 8 GiB in a sandbox of 512 MiB")
	case r.err != nil && !errors.As(r.err, &pe):
		t.Errorf("the memory hog's stream failed (agent lost?): %v", r.err)
	case r.code == 0:
		t.Errorf("the memory hog exited 0")
	}
	if st, err := os.Stat(fmt.Sprintf("/proc/%d", agent)); err != nil || st == nil {
		t.Errorf("the sandbox's agent (host pid %d) died with the hog", agent)
	}
	a.alive(t, 10*time.Second)
	b.alive(t, 10*time.Second)
	// The kill happened in the sandbox's own memory cgroup.
	if cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", agent)); err == nil {
		for _, l := range strings.Split(string(cg), "\n") {
			f := strings.SplitN(l, ":", 3)
			if len(f) == 3 && f[1] == "memory" {
				oc := readTrim(filepath.Join("/sys/fs/cgroup/memory", f[2], "memory.oom_control"))
				t.Logf("sandbox memory cgroup %s: %s", f[2], strings.ReplaceAll(oc, "\n", ", "))
				if !strings.Contains(oc, "oom_kill ") || strings.Contains(oc, "oom_kill 0") {
					t.Errorf("no OOM kill counted in the sandbox's memory cgroup %s", f[2])
				}
			}
		}
	}
}

// Disk filler: dd until it fails (or past the template's disk size): the
// platform and other sandboxes keep working.
func TestDiskFiller(t *testing.T) {
	p := shared(t)
	a, b := p.sandbox(t, false), p.sandbox(t, false)
	info, err := p.client.GetSandbox(context.Background(), a.ID)
	if err != nil {
		t.Fatal(err)
	}
	limitMB := info.DiskSizeMB + 256
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	out, done := a.start(ctx, "user", "/bin/bash", "-c", fmt.Sprintf("dd if=/dev/zero of=/home/user/fill bs=1M count=%d status=none; echo dd-exit $?; stat -c %%s /home/user/fill", limitMB))
	var r result
	for waiting := true; waiting; {
		select {
		case r = <-done:
			waiting = false
		case <-time.After(2 * time.Second):
			if d := b.alive(t, 15*time.Second); d > 5*time.Second {
				t.Errorf("another sandbox's command took %v during the disk filler", d)
			}
		}
	}
	t.Logf("disk filler: %s", strings.TrimSpace(out.String()))
	a.alive(t, 10*time.Second)
	b.alive(t, 10*time.Second)
	a.mustSh(t, "user", "rm -f /home/user/fill")
	if strings.Contains(r.out, "dd-exit 0") {
		testenv.Skipf(t, "no disk quota on this platform: the filler wrote %d MiB (the template's disk is %d MiB) without ENOSPC; TestDiskQuota asserts the quota",
			limitMB, info.DiskSizeMB)
	}
}

// TestDiskQuota: a sandbox's writes stop with ENOSPC at the template's
// disk size and the host loses no more than that.
func TestDiskQuota(t *testing.T) {
	p := shared(t)
	a := p.sandbox(t, false)
	info, err := p.client.GetSandbox(context.Background(), a.ID)
	if err != nil {
		t.Fatal(err)
	}
	quota := int64(info.DiskSizeMB) * mib
	if quota <= 0 {
		t.Fatalf("the template names no disk size (%d MiB)", info.DiskSizeMB)
	}
	free0 := hostFree(p.dataDir)
	r := a.sh(t, "user", fmt.Sprintf("dd if=/dev/zero of=/home/user/fill bs=1M count=%d status=none; echo dd-exit $?; stat -c %%s /home/user/fill; sync",
		info.DiskSizeMB+128))
	free1 := hostFree(p.dataDir)
	defer a.sh(t, "user", "rm -f /home/user/fill")
	t.Logf("dd of %d MiB: %s; host free %d -> %d MiB", info.DiskSizeMB+128, strings.TrimSpace(r.out), free0/mib, free1/mib)
	if !strings.Contains(r.out, "No space left on device") {
		t.Errorf("writing %d MiB in a sandbox with a %d MiB disk did not end with ENOSPC", info.DiskSizeMB+128, info.DiskSizeMB)
	}
	var size int64
	for _, l := range strings.Split(r.out, "\n") {
		if n, err := strconv.ParseInt(strings.TrimSpace(l), 10, 64); err == nil {
			size = n
		}
	}
	if size > quota {
		t.Errorf("the sandbox wrote %d MiB with a %d MiB disk", size/mib, info.DiskSizeMB)
	}
	// What the sandbox costs the host: its layer disk's image, exactly
	// (the largest image under the data dir is this sandbox's: it is the
	// only one that was filled).
	var img string
	var alloc int64
	_ = filepath.WalkDir(p.dataDir, func(path string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() && d.Name() == "layer.img" {
			var st syscall.Stat_t
			if syscall.Stat(path, &st) == nil && st.Blocks*512 > alloc {
				img, alloc = path, st.Blocks*512
			}
		}
		return nil
	})
	t.Logf("layer disk image %s: %d MiB allocated on the host", img, alloc/mib)
	if img == "" || alloc > quota+16*mib {
		t.Errorf("the sandbox's layer disk takes %d MiB of the host (%q), more than its %d MiB quota", alloc/mib, img, info.DiskSizeMB)
	}
	// Host-wide free space also moves with whatever else runs (make test
	// runs packages in parallel): allowed a little more slack.
	if free0 > free1 && int64(free0-free1) > quota+max(128*mib, quota/20) {
		t.Errorf("host free space dropped by %d MiB, more than the %d MiB quota", (free0-free1)/mib, info.DiskSizeMB)
	}
}
