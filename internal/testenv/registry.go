package testenv

import (
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/crypto/bcrypt"
)

// RegistryBin is Debian's docker-registry (make registry-deps installs it).
const RegistryBin = "/usr/bin/docker-registry"

// StartRegistry runs docker-registry on a free loopback port with its
// storage in a temp dir until t ends, with htpasswd auth when user is set,
// and returns its host:port. It skips t (through Skipf) without the binary.
func StartRegistry(t testing.TB, user, password string) string {
	t.Helper()
	if _, err := os.Stat(RegistryBin); err != nil {
		Skipf(t, "%s missing (make registry-deps installs Debian's docker-registry): %v", RegistryBin, err)
	}
	dir := t.TempDir()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	host := l.Addr().String()
	l.Close()
	cfg := fmt.Sprintf("version: 0.1\nlog:\n  level: error\n  accesslog:\n    disabled: true\nstorage:\n  filesystem:\n    rootdirectory: %s\nhttp:\n  addr: %s\n",
		filepath.Join(dir, "storage"), host)
	if user != "" {
		hash, err := bcrypt.GenerateFromPassword([]byte(password), bcrypt.MinCost)
		if err != nil {
			t.Fatal(err)
		}
		htp := filepath.Join(dir, "htpasswd")
		if err := os.WriteFile(htp, []byte(user+":"+string(hash)+"\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		cfg += fmt.Sprintf("auth:\n  htpasswd:\n    realm: space-test\n    path: %s\n", htp)
	}
	cfgPath := filepath.Join(dir, "config.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(RegistryBin, "serve", cfgPath)
	out, err := os.Create(filepath.Join(dir, "registry.log"))
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait(); out.Close() })
	deadline := time.Now().Add(15 * time.Second)
	probe := &http.Client{Transport: &http.Transport{DisableKeepAlives: true}, Timeout: time.Second}
	for {
		if resp, err := probe.Get("http://" + host + "/v2/"); err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK || resp.StatusCode == http.StatusUnauthorized {
				return host
			}
		}
		if time.Now().After(deadline) {
			log, _ := os.ReadFile(out.Name())
			t.Fatalf("docker-registry not ready on %s:\n%s", host, log)
		}
		time.Sleep(30 * time.Millisecond)
	}
}
