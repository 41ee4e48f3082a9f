package edgecert

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/spacesbx/space/internal/errdefs"
	"github.com/spacesbx/space/internal/testenv"
)

type clock struct {
	mu sync.Mutex
	t  time.Time
}

func newClock() *clock { return &clock{t: time.Date(2030, 1, 1, 0, 0, 0, 0, time.UTC)} }
func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}
func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.t = c.t.Add(d)
	c.mu.Unlock()
}

func newLocal(t *testing.T, dir, domain string, clk *clock) *Certs {
	t.Helper()
	c, err := New(Config{Domain: domain, Dir: dir, Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func roots(t *testing.T, c *Certs) *x509.CertPool {
	t.Helper()
	b, err := os.ReadFile(c.CAFile())
	if err != nil {
		t.Fatal(err)
	}
	p := x509.NewCertPool()
	if !p.AppendCertsFromPEM(b) {
		t.Fatal("ca.pem holds no certificate")
	}
	return p
}

func leafFor(t *testing.T, c *Certs, name string) *x509.Certificate {
	t.Helper()
	l, err := c.GetCertificate(&tls.ClientHelloInfo{ServerName: name})
	if err != nil {
		t.Fatalf("certificate for %q: %v", name, err)
	}
	return l.Leaf
}

// TestLocalCA: the CA is made once (key 0600), ECDSA, may sign only for
// the domain, and its leaves verify for <port>-<id>.<domain>, the domain
// and *.<domain>, for server auth only.
func TestLocalCA(t *testing.T) {
	dir, clk := filepath.Join(t.TempDir(), "tls"), newClock()
	c := newLocal(t, dir, "localhost", clk)
	if !c.CACreated() || c.CAFile() != filepath.Join(dir, CAFileName) {
		t.Fatalf("created %v, file %q", c.CACreated(), c.CAFile())
	}
	fi, err := os.Stat(filepath.Join(dir, CAKeyFileName))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("ca key: %v %v", fi, err)
	}
	if _, ok := c.ca.PublicKey.(*ecdsa.PublicKey); !ok || !c.ca.PermittedDNSDomainsCritical ||
		len(c.ca.PermittedDNSDomains) != 1 || c.ca.PermittedDNSDomains[0] != "localhost" || !c.ca.MaxPathLenZero {
		t.Fatalf("ca: %T %v %v", c.ca.PublicKey, c.ca.PermittedDNSDomains, c.ca.MaxPathLenZero)
	}
	pool := roots(t, c)
	for _, name := range []string{"8000-abc.localhost", "49983-i2x3.localhost", "localhost", ""} {
		leaf := leafFor(t, c, name)
		want := name
		if want == "" {
			want = "localhost"
		}
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: want, Roots: pool, CurrentTime: clk.Now(),
			KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("leaf for %q: %v", name, err)
		}
		if !leaf.NotAfter.After(clk.Now().Add(LeafRenewBefore)) {
			t.Errorf("leaf for %q ends %v", name, leaf.NotAfter)
		}
	}
	// A second start reuses the CA.
	c2 := newLocal(t, dir, "localhost", clk)
	if c2.CACreated() || !bytes.Equal(c2.ca.Raw, c.ca.Raw) {
		t.Fatal("second start made a new CA")
	}
	// The same leaf is served until it nears its end.
	a, b := leafFor(t, c, "8000-abc.localhost"), leafFor(t, c, "8000-abc.localhost")
	if a.SerialNumber.Cmp(b.SerialNumber) != 0 {
		t.Fatal("leaf minted twice")
	}
}

// TestNameConstraint: the CA's key cannot vouch for another domain or an
// IP address, whoever holds it.
func TestNameConstraint(t *testing.T) {
	clk := newClock()
	c := newLocal(t, t.TempDir(), "sbx.example.test", clk)
	pool := roots(t, c)
	for _, tc := range []struct {
		dns []string
		ip  net.IP
	}{
		{dns: []string{"evil.test"}},
		{dns: []string{"8000-a.sbx.example.test", "bank.test"}},
		{ip: net.IPv4(127, 0, 0, 1)},
	} {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: c.ca.SerialNumber, Subject: pkix.Name{CommonName: "x"}, DNSNames: tc.dns,
			NotBefore: clk.Now().Add(-time.Hour), NotAfter: clk.Now().Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
		if tc.ip != nil {
			tmpl.IPAddresses = []net.IP{tc.ip}
		}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, c.ca, &key.PublicKey, c.caKey)
		if err != nil {
			t.Fatal(err)
		}
		leaf, _ := x509.ParseCertificate(der)
		if _, err := leaf.Verify(x509.VerifyOptions{Roots: pool, CurrentTime: clk.Now()}); err == nil {
			t.Errorf("a leaf for %v %v verified under the constrained CA", tc.dns, tc.ip)
		}
	}
}

// TestLeafRejections: names outside <label>.<domain> get no certificate,
// so the handshake fails.
func TestLeafRejections(t *testing.T) {
	c := newLocal(t, t.TempDir(), "localhost", newClock())
	for _, name := range []string{"example.com", "a.b.localhost", "8000-abc.localhost.evil", "xlocalhost", "-8000.localhost",
		"8000_x.localhost", "*.localhost", strings.Repeat("a", 64) + ".localhost", ".localhost"} {
		_, err := c.GetCertificate(&tls.ClientHelloInfo{ServerName: name})
		if !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%q: %v", name, err)
		}
	}
	// Upper case and a trailing dot are the same name.
	if l := leafFor(t, c, "8000-ABC.localhost."); l.DNSNames[0] != "8000-abc.localhost" {
		t.Fatalf("names %v", l.DNSNames)
	}
}

// TestRotation: leaves are renewed before they end; the CA is replaced at
// start when it nears its end or names another domain.
func TestRotation(t *testing.T) {
	dir, clk := t.TempDir(), newClock()
	c := newLocal(t, dir, "localhost", clk)
	first := leafFor(t, c, "8000-abc.localhost")
	clk.Advance(LeafLifetime - LeafRenewBefore + time.Hour)
	second := leafFor(t, c, "8000-abc.localhost")
	if second.SerialNumber.Cmp(first.SerialNumber) == 0 || !second.NotAfter.After(first.NotAfter) {
		t.Fatalf("leaf not renewed: %v then %v", first.NotAfter, second.NotAfter)
	}
	old := c.ca.Raw
	clk.Advance(CALifetime - CARenewBefore)
	c2 := newLocal(t, dir, "localhost", clk)
	if !c2.CACreated() || bytes.Equal(c2.ca.Raw, old) {
		t.Fatal("CA near its end was kept")
	}
	// A leaf never outlives its CA.
	clk.Advance(CALifetime - 24*time.Hour)
	c3 := newLocal(t, dir, "localhost", clk)
	if l := leafFor(t, c3, "8000-abc.localhost"); l.NotAfter.After(c3.ca.NotAfter) {
		t.Fatalf("leaf ends %v after the CA %v", l.NotAfter, c3.ca.NotAfter)
	}
	c4 := newLocal(t, dir, "sbx.example.test", clk)
	if !c4.CACreated() || c4.ca.PermittedDNSDomains[0] != "sbx.example.test" {
		t.Fatal("CA of another domain was kept")
	}
}

// TestCorruptCA: unusable CA files are replaced, unreadable ones are an
// error.
func TestCorruptCA(t *testing.T) {
	dir, clk := t.TempDir(), newClock()
	for _, bad := range [][2]string{{"junk", "junk"}, {"", ""}} {
		os.WriteFile(filepath.Join(dir, CAFileName), []byte(bad[0]), 0o644)
		os.WriteFile(filepath.Join(dir, CAKeyFileName), []byte(bad[1]), 0o600)
		if c := newLocal(t, dir, "localhost", clk); !c.CACreated() {
			t.Fatal("corrupt CA kept")
		}
	}
	// The key of another CA beside the certificate.
	other := newLocal(t, t.TempDir(), "localhost", clk)
	kb, _ := os.ReadFile(filepath.Join(filepath.Dir(other.CAFile()), CAKeyFileName))
	os.WriteFile(filepath.Join(dir, CAKeyFileName), kb, 0o600)
	if c := newLocal(t, dir, "localhost", clk); !c.CACreated() {
		t.Fatal("CA with a foreign key kept")
	}
	if !testenv.IsRoot() { // root reads a 0000 file
		os.Chmod(filepath.Join(dir, CAKeyFileName), 0)
		if _, err := New(Config{Domain: "localhost", Dir: dir, Clock: clk.Now}); err == nil {
			t.Fatal("unreadable key: no error")
		}
	}
}

func writePair(t *testing.T, dir string, names []string, notAfter time.Time) (string, string) {
	t.Helper()
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	serial, _ := randSerial()
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: names[0]}, DNSNames: names,
		NotBefore: notAfter.Add(-48 * time.Hour), NotAfter: notAfter, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	kder, _ := x509.MarshalPKCS8PrivateKey(key)
	cf, kf := filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	os.WriteFile(cf, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	os.WriteFile(kf, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: kder}), 0o600)
	return cf, kf
}

// TestOperatorCertificate: the operator's pair is served for every name;
// one for another name, an expired one, a mismatched key or half a pair
// is refused at start; a renewed pair is picked up, a bad renewal is not.
func TestOperatorCertificate(t *testing.T) {
	dir, clk := t.TempDir(), newClock()
	cf, kf := writePair(t, dir, []string{"*.sbx.example.test", "sbx.example.test"}, clk.Now().Add(30*24*time.Hour))
	c, err := New(Config{Domain: "sbx.example.test", CertFile: cf, KeyFile: kf, Clock: clk.Now})
	if err != nil {
		t.Fatal(err)
	}
	if c.CAFile() != "" || c.CACreated() {
		t.Fatal("operator certificate reports a local CA")
	}
	got, err := c.GetCertificate(&tls.ClientHelloInfo{ServerName: "8000-abc.sbx.example.test"})
	if err != nil || got.Leaf.VerifyHostname("8000-abc.sbx.example.test") != nil {
		t.Fatalf("operator leaf: %v", err)
	}
	// Renewal in place: picked up after the recheck interval.
	time.Sleep(10 * time.Millisecond) // a distinct mtime
	writePair(t, dir, []string{"*.sbx.example.test"}, clk.Now().Add(60*24*time.Hour))
	clk.Advance(operatorRecheck + time.Second)
	renewed, _ := c.GetCertificate(&tls.ClientHelloInfo{})
	if renewed.Leaf.SerialNumber.Cmp(got.Leaf.SerialNumber) == 0 || !renewed.Leaf.NotAfter.After(got.Leaf.NotAfter) {
		t.Fatal("renewed pair not loaded")
	}
	// A renewal for another name is refused; the pair in use stays.
	time.Sleep(10 * time.Millisecond)
	writePair(t, dir, []string{"other.test"}, clk.Now().Add(90*24*time.Hour))
	clk.Advance(operatorRecheck + time.Second)
	if kept, _ := c.GetCertificate(&tls.ClientHelloInfo{}); kept != renewed {
		t.Fatal("a certificate for another name replaced the one in use")
	}

	bad := t.TempDir()
	for name, tc := range map[string]struct {
		names    []string
		notAfter time.Time
	}{
		"another name":        {[]string{"*.other.test"}, clk.Now().Add(time.Hour)},
		"the apex only":       {[]string{"sbx.example.test"}, clk.Now().Add(time.Hour)},
		"a deeper wildcard":   {[]string{"*.a.sbx.example.test"}, clk.Now().Add(time.Hour)},
		"expired":             {[]string{"*.sbx.example.test"}, clk.Now().Add(-time.Minute)},
		"a parent's wildcard": {[]string{"*.example.test"}, clk.Now().Add(time.Hour)},
	} {
		cf, kf := writePair(t, bad, tc.names, tc.notAfter)
		if _, err := New(Config{Domain: "sbx.example.test", CertFile: cf, KeyFile: kf, Clock: clk.Now}); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
	cf2, _ := writePair(t, t.TempDir(), []string{"*.sbx.example.test"}, clk.Now().Add(time.Hour))
	if _, err := New(Config{Domain: "sbx.example.test", CertFile: cf2, KeyFile: kf, Clock: clk.Now}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("mismatched key: %v", err)
	}
	if _, err := New(Config{Domain: "sbx.example.test", CertFile: cf2, Clock: clk.Now}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("half a pair: %v", err)
	}
	if _, err := New(Config{Domain: "sbx.example.test", CertFile: filepath.Join(bad, "none"), KeyFile: kf, Clock: clk.Now}); err == nil {
		t.Error("missing file: no error")
	}
}

func TestConfigValidate(t *testing.T) {
	for _, d := range []string{"", "localhost:3443", "https://localhost", "*.localhost", "a..b", "-a.b", "a b"} {
		if err := (Config{Domain: d, Dir: "x"}).Validate(); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("domain %q: %v", d, err)
		}
	}
	if err := (Config{Domain: "localhost"}).Validate(); err == nil {
		t.Error("no Dir and no certificate: valid")
	}
	if err := (Config{Domain: "Sbx.Example.Test.", Dir: "x"}).Validate(); err != nil {
		t.Error(err)
	}
}

// TestHandshake: a real TLS client trusting only the CA file connects for
// a sandbox name and is refused for others.
func TestHandshake(t *testing.T) {
	clk := &clock{t: time.Now()}
	c := newLocal(t, t.TempDir(), "localhost", clk)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", c.TLSConfig())
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	defer wg.Wait()
	defer ln.Close()
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			_ = conn.(*tls.Conn).Handshake()
			conn.Close()
		}
	}()
	dial := func(name string) error {
		conn, err := tls.Dial("tcp", ln.Addr().String(), &tls.Config{ServerName: name, RootCAs: roots(t, c)})
		if err == nil {
			if p := conn.ConnectionState().NegotiatedProtocol; p != "" && p != "http/1.1" {
				t.Errorf("protocol %q", p)
			}
			conn.Close()
		}
		return err
	}
	if err := dial("8000-abc.localhost"); err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"a.b.localhost", "example.com"} {
		if err := dial(name); err == nil {
			t.Errorf("%q: handshake succeeded", name)
		}
	}
}

// TestOpenSSLAcceptsChain: OpenSSL (what Node and curl verify with)
// accepts a leaf under the name-constrained CA, and refuses the
// certificate for a name the leaf does not carry.
func TestOpenSSLAcceptsChain(t *testing.T) {
	if _, err := exec.LookPath("openssl"); err != nil {
		testenv.Skipf(t, "openssl is not installed (Debian's openssl package)")
	}
	clk := &clock{t: time.Now()}
	dir := t.TempDir()
	c := newLocal(t, dir, "localhost", clk)
	leaf := leafFor(t, c, "8000-abc.localhost")
	lf := filepath.Join(dir, "leaf.pem")
	os.WriteFile(lf, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: leaf.Raw}), 0o644)
	for name, ok := range map[string]bool{"8000-abc.localhost": true, "other.localhost": false} {
		out, err := exec.Command("openssl", "verify", "-CAfile", c.CAFile(), "-verify_hostname", name, "-purpose", "sslserver", lf).CombinedOutput()
		if (err == nil) != ok {
			t.Errorf("openssl verify for %s: %v\n%s", name, err, out)
		}
	}
	// A leaf the CA's key signs for another domain: OpenSSL applies the
	// name constraint too.
	key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	serial, _ := randSerial()
	tmpl := &x509.Certificate{SerialNumber: serial, Subject: pkix.Name{CommonName: "bank.test"}, DNSNames: []string{"bank.test"},
		NotBefore: clk.Now().Add(-time.Hour), NotAfter: clk.Now().Add(time.Hour), ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, c.ca, &key.PublicKey, c.caKey)
	if err != nil {
		t.Fatal(err)
	}
	os.WriteFile(lf, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
	if out, err := exec.Command("openssl", "verify", "-CAfile", c.CAFile(), "-purpose", "sslserver", lf).CombinedOutput(); err == nil {
		t.Errorf("openssl accepted a leaf for bank.test:\n%s", out)
	}
}

// FuzzServerName: any server name either gets no certificate or a leaf
// that names exactly it under the domain and verifies for it.
func FuzzServerName(f *testing.F) {
	for _, s := range []string{"", "localhost", "8000-abc.localhost", "a.b.localhost", "8000-ABC.localhost.", "x\x00.localhost", "..localhost"} {
		f.Add(s)
	}
	clk := &clock{t: time.Now()}
	c, err := New(Config{Domain: "localhost", Dir: f.TempDir(), Clock: clk.Now})
	if err != nil {
		f.Fatal(err)
	}
	b, _ := os.ReadFile(c.CAFile())
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(b)
	f.Fuzz(func(t *testing.T, name string) {
		l, err := c.GetCertificate(&tls.ClientHelloInfo{ServerName: name})
		if err != nil {
			if !errors.Is(err, errdefs.ErrNotFound) {
				t.Fatalf("%q: unclassified %v", name, err)
			}
			return
		}
		n := normName(name)
		if n == "" {
			n = "localhost"
		}
		if !strings.HasSuffix(n, "localhost") {
			t.Fatalf("%q: a certificate outside the domain", name)
		}
		if _, err := l.Leaf.Verify(x509.VerifyOptions{DNSName: n, Roots: pool, CurrentTime: clk.Now()}); err != nil {
			t.Fatalf("%q: %v", name, err)
		}
	})
}
