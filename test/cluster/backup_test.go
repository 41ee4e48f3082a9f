package cluster

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sort"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/hostsim"
)

// backupRestore: etcd backed up from the running cluster (etcdctl
// snapshot save, from the client's host) and restored into a fresh
// one-member cluster on a new host; a control plane started on it lists
// every sandbox record and template the running cluster had at the
// backup (docs/OPERATIONS.md, "Backups").
// It returns the line the report gets.
func backupRestore(t *testing.T, c *cluster, l *load) string {
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	// A template of the team's own (its record; the build need not run).
	if _, err := l.clients[0].RequestBuild(ctx, "cluster-backup", nil); err != nil {
		t.Fatalf("template: %v", err)
	}
	wantSbx, err := c.listIDs(ctx, c.apiURL(0)+"/v2/sandboxes?limit=100", "sandboxID")
	if err != nil {
		t.Fatal(err)
	}
	wantTpl, err := c.listIDs(ctx, c.apiURL(0)+"/templates", "templateID")
	if err != nil {
		t.Fatal(err)
	}
	if len(wantSbx) == 0 || !slices.ContainsFunc(wantTpl, func(s string) bool { return s != "" }) {
		t.Fatalf("nothing to back up: sandboxes %v templates %v", wantSbx, wantTpl)
	}

	bdir := filepath.Join(c.dir, "backup")
	if err := os.MkdirAll(bdir, 0o700); err != nil {
		t.Fatal(err)
	}
	db := filepath.Join(bdir, "etcd.db")
	// etcdctl saves from one member (the snapshot is that member's).
	member := fmt.Sprintf("http://%s", netip.AddrPortFrom(c.etcd[0].Addr(), etcdClientPort))
	t0 := time.Now()
	runOnce(t, c.client, "snapshot-save", "/usr/bin/etcdctl", "--endpoints", member, "snapshot", "save", db)
	saveTook := time.Since(t0)
	// The snapshot store is plain files: copied beside it.
	if out, err := exec.Command("cp", "-a", c.snapDir, filepath.Join(bdir, "snapshots")).CombinedOutput(); err != nil {
		t.Fatalf("copy the snapshot dir: %v %s", err, out)
	}

	// Restore into a fresh member on a host of its own.
	rh, err := c.net.Host("etcd-r")
	if err != nil {
		t.Fatal(err)
	}
	ah, err := c.net.Host("api-r")
	if err != nil {
		t.Fatal(err)
	}
	peer := fmt.Sprintf("http://%s", netip.AddrPortFrom(rh.Addr(), etcdPeerPort))
	rdata := filepath.Join(c.dir, "etcd-r")
	restore := []string{"snapshot", "restore", db, "--name", "r1", "--data-dir", rdata,
		"--initial-cluster", "r1=" + peer, "--initial-advertise-peer-urls", peer, "--initial-cluster-token", "space-restored"}
	tool := "/usr/bin/etcdutl" // etcd 3.5+; 3.4 restores with etcdctl
	if _, err := os.Stat(tool); err != nil {
		tool = "/usr/bin/etcdctl"
	}
	t0 = time.Now()
	runOnce(t, c.client, "snapshot-rest", tool, restore...)
	c.startEtcd(rh, "r1", rdata, "r1="+peer)
	if err := c.waitUp(fmt.Sprintf("http://%s/health", netip.AddrPortFrom(rh.Addr(), etcdClientPort)), 60*time.Second); err != nil {
		t.Fatal(err)
	}
	ep := fmt.Sprintf("http://%s", netip.AddrPortFrom(rh.Addr(), etcdClientPort))
	c.start(ah, "space-api", filepath.Join(c.bin, "space-api"), "--addr", netip.AddrPortFrom(ah.Addr(), apiPort).String(),
		"--data-dir", filepath.Join(c.dir, "api-r"), "--etcd-endpoints", ep, "--api-key", apiKey, "--metrics-addr", "off")
	defer func() {
		for _, h := range []*hostsim.Host{ah, rh} {
			if _, err := h.Stop(20 * time.Second); err != nil {
				t.Errorf("stop %s: %v", h.Name(), err)
			}
		}
	}()
	api := "http://" + netip.AddrPortFrom(ah.Addr(), apiPort).String()
	if err := c.waitUp(api+"/health", 60*time.Second); err != nil {
		t.Fatal(err)
	}
	restoreTook := time.Since(t0)
	gotSbx, err := c.listIDs(ctx, api+"/v2/sandboxes?limit=100", "sandboxID")
	if err != nil {
		t.Fatal(err)
	}
	gotTpl, err := c.listIDs(ctx, api+"/templates", "templateID")
	if err != nil {
		t.Fatal(err)
	}
	line := fmt.Sprintf("etcd backup/restore (snapshot save from a member of the running cluster, restore into a fresh one, a control plane on it): save %v, restore + etcd + control plane up %v; sandboxes %d of %d, templates %d of %d",
		saveTook.Round(time.Millisecond), restoreTook.Round(time.Millisecond), len(gotSbx), len(wantSbx), len(gotTpl), len(wantTpl))
	t.Log(line)
	if !slices.Equal(gotSbx, wantSbx) {
		t.Errorf("sandboxes after restore %v, want %v", gotSbx, wantSbx)
	}
	if !slices.Equal(gotTpl, wantTpl) {
		t.Errorf("templates after restore %v, want %v", gotTpl, wantTpl)
	}
	return line
}

// runOnce runs a command on h and waits for it to exit 0.
func runOnce(t *testing.T, h *hostsim.Host, name, path string, args ...string) {
	t.Helper()
	p, err := h.Start(name, hostsim.Command{Path: path, Args: args, Env: append([]string{"ETCDCTL_API=3"}, hostEnv...)})
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-p.Done():
	case <-time.After(2 * time.Minute):
		t.Fatalf("%s still runs after 2 minutes", name)
	}
	if st := p.ProcessState(); !st.Success() {
		b, _ := os.ReadFile(p.Log)
		t.Fatalf("%s: %v\n%s", name, st, b)
	}
}

// listIDs GETs a JSON list and returns the sorted values of field.
func (c *cluster) listIDs(ctx context.Context, url, field string) ([]string, error) {
	var items []map[string]any
	if _, err := c.get(ctx, url, &items); err != nil {
		return nil, err
	}
	var out []string
	for _, it := range items {
		if s, ok := it[field].(string); ok {
			out = append(out, s)
		}
	}
	sort.Strings(out)
	return out, nil
}
