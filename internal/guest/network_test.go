package guest

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"log/slog"
	"math/big"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// testCAPEM returns a fresh self-signed CA certificate as PEM.
func testCAPEM(t testing.TB, name string) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}))
}

func validNetwork(t testing.TB) *NetworkConfig {
	return &NetworkConfig{Address: "10.201.0.6/30", Gateway: "10.201.0.5", DNS: "10.201.0.5",
		MAC: "02:53:50:00:00:01", MTU: 1500, CACert: testCAPEM(t, "space egress test")}
}

func TestNetworkConfigValidateRejects(t *testing.T) {
	if err := validNetwork(t).Validate(); err != nil {
		t.Fatalf("valid config: %v", err)
	}
	keyPEM := "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
	for name, mod := range map[string]func(n *NetworkConfig){
		"no address":        func(n *NetworkConfig) { n.Address = "" },
		"address no prefix": func(n *NetworkConfig) { n.Address = "10.201.0.6" },
		"address v6":        func(n *NetworkConfig) { n.Address = "fd00::2/64" },
		"address /0":        func(n *NetworkConfig) { n.Address = "10.201.0.6/0" },
		"gateway garbage":   func(n *NetworkConfig) { n.Gateway = "gw" },
		"gateway off link":  func(n *NetworkConfig) { n.Gateway = "10.201.0.9" },
		"gateway is self":   func(n *NetworkConfig) { n.Gateway = "10.201.0.6" },
		"dns garbage":       func(n *NetworkConfig) { n.DNS = "10.0.0.1\noptions x" },
		"dns empty":         func(n *NetworkConfig) { n.DNS = "" },
		"mac garbage":       func(n *NetworkConfig) { n.MAC = "zz" },
		"mac eui64":         func(n *NetworkConfig) { n.MAC = "02:00:00:00:00:00:00:01" },
		"mtu small":         func(n *NetworkConfig) { n.MTU = 67 },
		"mtu big":           func(n *NetworkConfig) { n.MTU = 65536 },
		"ca not pem":        func(n *NetworkConfig) { n.CACert = "hello" },
		"ca private key":    func(n *NetworkConfig) { n.CACert = keyPEM },
		"ca cert and key":   func(n *NetworkConfig) { n.CACert += keyPEM },
		"ca trailing junk":  func(n *NetworkConfig) { n.CACert += "junk\n" },
		"ca bad der":        func(n *NetworkConfig) { n.CACert = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n" },
		"ca too big":        func(n *NetworkConfig) { n.CACert = strings.Repeat(n.CACert, maxCACertBytes/len(n.CACert)+1) },
	} {
		n := validNetwork(t)
		mod(n)
		if err := n.Validate(); err == nil {
			t.Errorf("%s: accepted %+v", name, n)
		}
		// The agent's config is refused as a whole.
		cfg := Config{Identity: Identity{Sandbox: "s", Execution: "e", Worker: "w", Substrate: "ns", Activation: "a"}, Network: n}
		if err := cfg.Validate(); err == nil {
			t.Errorf("%s: Config.Validate accepted it", name)
		}
	}
}

// netRoot is a temporary root with the network files' paths in it.
type netRoot struct{ dir, resolv, cert, bundle string }

func newNetRoot(t *testing.T) netRoot {
	d := t.TempDir()
	return netRoot{d, filepath.Join(d, "etc/resolv.conf"), filepath.Join(d, "usr/local/share/ca-certificates/space-egress.crt"),
		filepath.Join(d, "etc/ssl/certs/ca-certificates.crt")}
}

func (r netRoot) config(n *NetworkConfig) Config {
	return Config{Network: n, ResolvConfPath: r.resolv, CACertPath: r.cert, CABundlePath: r.bundle}
}

func readFile(t *testing.T, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestApplyNetworkFiles(t *testing.T) {
	r := newNetRoot(t)
	// An image whose resolv.conf links elsewhere and whose bundle has a CA.
	if err := os.MkdirAll(filepath.Dir(r.bundle), 0o755); err != nil {
		t.Fatal(err)
	}
	other := testCAPEM(t, "some public root")
	if err := os.WriteFile(r.bundle, []byte(strings.TrimSuffix(other, "\n")), 0o644); err != nil { // no final newline
		t.Fatal(err)
	}
	target := filepath.Join(r.dir, "run-resolved.conf")
	if err := os.WriteFile(target, []byte("nameserver 127.0.0.53\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(target, r.resolv); err != nil {
		t.Fatal(err)
	}

	n := validNetwork(t)
	for range 2 { // idempotent
		if err := applyNetworkFiles(r.config(n)); err != nil {
			t.Fatal(err)
		}
	}
	if fi, err := os.Lstat(r.resolv); err != nil || !fi.Mode().IsRegular() || fi.Mode().Perm() != 0o644 {
		t.Fatalf("resolv.conf: %v, %v; want a regular 0644 file", fi, err)
	}
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.5\n" {
		t.Errorf("resolv.conf = %q", got)
	}
	if got := readFile(t, target); got != "nameserver 127.0.0.53\n" {
		t.Errorf("the link's target was written: %q", got)
	}
	if got := readFile(t, r.cert); got != n.CACert {
		t.Errorf("space-egress.crt = %q, want the CA", got)
	}
	bundle := readFile(t, r.bundle)
	want := other + caBlockBegin + "\n" + n.CACert + caBlockEnd + "\n"
	if bundle != want {
		t.Errorf("bundle after two applies:\n%s\nwant\n%s", bundle, want)
	}

	// A move: a new CA and resolver replace the old ones.
	n2 := validNetwork(t)
	n2.DNS, n2.CACert = "10.201.0.9", testCAPEM(t, "space egress moved")
	if err := applyNetworkFiles(r.config(n2)); err != nil {
		t.Fatal(err)
	}
	bundle = readFile(t, r.bundle)
	if strings.Contains(bundle, n.CACert) || strings.Count(bundle, n2.CACert) != 1 || strings.Count(bundle, caBlockBegin) != 1 || !strings.HasPrefix(bundle, other) {
		t.Errorf("bundle after a new CA:\n%s", bundle)
	}
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.9\n" {
		t.Errorf("resolv.conf = %q", got)
	}

	// No CA any more: the stale one is no longer trusted.
	n3 := validNetwork(t)
	n3.CACert = ""
	if err := applyNetworkFiles(r.config(n3)); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, r.bundle); got != other {
		t.Errorf("bundle without CA = %q, want the image's %q", got, other)
	}
	if _, err := os.Stat(r.cert); !os.IsNotExist(err) {
		t.Errorf("space-egress.crt still there: %v", err)
	}
	// Nil changes nothing.
	if err := applyNetworkFiles(r.config(nil)); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.5\n" {
		t.Errorf("nil network changed resolv.conf: %q", got)
	}
	// No temporary files left behind.
	for _, d := range []string{filepath.Dir(r.resolv), filepath.Dir(r.bundle), filepath.Dir(r.cert)} {
		ents, _ := os.ReadDir(d)
		for _, e := range ents {
			if strings.Contains(e.Name(), ".tmp-") {
				t.Errorf("left %s in %s", e.Name(), d)
			}
		}
	}
}

func TestApplyNetworkFilesCreatesMissing(t *testing.T) {
	r := newNetRoot(t) // no etc, no ssl, no share: all created
	n := validNetwork(t)
	if err := applyNetworkFiles(r.config(n)); err != nil {
		t.Fatal(err)
	}
	if got, want := readFile(t, r.bundle), caBlockBegin+"\n"+n.CACert+caBlockEnd+"\n"; got != want {
		t.Errorf("bundle = %q, want %q", got, want)
	}
	if readFile(t, r.cert) != n.CACert || readFile(t, r.resolv) != "nameserver 10.201.0.5\n" {
		t.Error("cert or resolv.conf not written")
	}
	// Without a CA and without a bundle, no empty bundle appears.
	r2 := newNetRoot(t)
	n.CACert = ""
	if err := applyNetworkFiles(r2.config(n)); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(r2.bundle); !os.IsNotExist(err) {
		t.Errorf("bundle created without a CA: %v", err)
	}
}

func TestApplyNetworkFilesReportsFailure(t *testing.T) {
	r := newNetRoot(t)
	// A directory where resolv.conf should be: the rename fails.
	if err := os.MkdirAll(filepath.Join(r.resolv, "x"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := applyNetworkFiles(r.config(validNetwork(t))); err == nil || !strings.Contains(err.Error(), "resolv.conf") {
		t.Fatalf("err = %v, want a resolv.conf error", err)
	}
	// The CA is still applied: one failure does not stop the rest.
	if _, err := os.Stat(r.cert); err != nil {
		t.Errorf("CA not written after the resolv.conf failure: %v", err)
	}
}

// TestServerAppliesNetwork is ns mode: the agent's config (as
// SPACE_GUEST_CONFIG carries it) applies the network at start, a later
// activation applies its own.
func TestServerAppliesNetwork(t *testing.T) {
	r := newNetRoot(t)
	cfg := r.config(validNetwork(t))
	cfg.Identity = Identity{Sandbox: "s", Execution: "e", Worker: "w", Substrate: "ns", Activation: "a1"}
	cfg.Logger = slog.New(slog.NewTextHandler(io.Discard, nil))
	srv, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.5\n" {
		t.Errorf("resolv.conf at start = %q", got)
	}
	if !strings.Contains(readFile(t, r.bundle), cfg.Network.CACert) {
		t.Error("CA not in the bundle at start")
	}
	n2 := validNetwork(t)
	n2.DNS = "10.201.0.13"
	cfg2 := cfg
	cfg2.Identity.Activation, cfg2.Network = "a2", n2
	// Paths of a reactivation are ignored: the first ones stay.
	cfg2.ResolvConfPath = filepath.Join(r.dir, "elsewhere")
	if err := srv.Reactivate(cfg2); err != nil {
		t.Fatal(err)
	}
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.13\n" {
		t.Errorf("resolv.conf after reactivation = %q", got)
	}
	if b := readFile(t, r.bundle); strings.Contains(b, cfg.Network.CACert) || !strings.Contains(b, n2.CACert) {
		t.Error("the reactivation's CA did not replace the first")
	}
	// An invalid network refuses the reactivation and changes nothing.
	bad := cfg2
	bad.Network = &NetworkConfig{Address: "x", Gateway: "y", DNS: "z"}
	if err := srv.Reactivate(bad); err == nil {
		t.Fatal("reactivation with an invalid network accepted")
	}
	if got := readFile(t, r.resolv); got != "nameserver 10.201.0.13\n" {
		t.Errorf("resolv.conf after a refused reactivation = %q", got)
	}
}

func TestStripCABlocks(t *testing.T) {
	for in, want := range map[string]string{
		"":  "",
		"a": "a",
		"a\n" + caBlockBegin + "\nX\n" + caBlockEnd + "\nb\n":                                   "a\nb\n",
		caBlockBegin + "\nX\n" + caBlockEnd + "\n" + caBlockBegin + "\nY\n" + caBlockEnd + "\n": "",
		"a\n" + caBlockBegin + "\nX\n":                                                          "a\n",
		"a\r\n" + caBlockBegin + "\r\nX\r\n" + caBlockEnd + "\r\nb":                             "a\r\nb",
	} {
		if got := string(stripCABlocks([]byte(in))); got != want {
			t.Errorf("stripCABlocks(%q) = %q, want %q", in, got, want)
		}
	}
}

// FuzzApplyCACertBundle: whatever the bundle held, applying a CA leaves
// exactly one block holding it, and applying none leaves no block.
func FuzzApplyCACertBundle(f *testing.F) {
	ca := testCAPEM(f, "fuzz")
	f.Add([]byte("x\n"))
	f.Add([]byte(caBlockBegin + "\nold\n" + caBlockEnd + "\n"))
	f.Add([]byte(caBlockBegin + "\n" + caBlockBegin + "\n" + caBlockEnd))
	f.Fuzz(func(t *testing.T, old []byte) {
		d := t.TempDir()
		cert, bundle := filepath.Join(d, "c.crt"), filepath.Join(d, "bundle")
		if err := os.WriteFile(bundle, old, 0o644); err != nil {
			t.Fatal(err)
		}
		if err := applyCACert(cert, bundle, ca); err != nil {
			t.Fatal(err)
		}
		b, _ := os.ReadFile(bundle)
		if strings.Count(string(b), ca) < 1 || strings.Count(string(b), caBlockBegin+"\n"+ca+caBlockEnd+"\n") != 1 {
			t.Fatalf("bundle from %q:\n%q", old, b)
		}
		if err := applyCACert(cert, bundle, ""); err != nil {
			t.Fatal(err)
		}
		b, _ = os.ReadFile(bundle)
		if strings.Contains(string(stripCABlocks(b)), caBlockBegin+"\n"+ca) || string(stripCABlocks(b)) != string(b) {
			t.Fatalf("block left after removal from %q:\n%q", old, b)
		}
	})
}

// FuzzNetworkConfigValidate: no input panics, and whatever passes
// Validate is applied without a parse error.
func FuzzNetworkConfigValidate(f *testing.F) {
	f.Add("10.0.0.2/30", "10.0.0.1", "10.0.0.1", "02:00:00:00:00:01", 1500, testCAPEM(f, "seed"))
	f.Add("x", "y", "z", "", 0, "")
	f.Fuzz(func(t *testing.T, addr, gw, dns, mac string, mtu int, ca string) {
		n := &NetworkConfig{Address: addr, Gateway: gw, DNS: dns, MAC: mac, MTU: mtu, CACert: ca}
		if n.Validate() != nil {
			return
		}
		if strings.ContainsAny(dns, "\n\r ") {
			t.Fatalf("dns %q passed", dns)
		}
		if _, err := parseCACert(ca); ca != "" && err != nil {
			t.Fatal(err)
		}
	})
}
