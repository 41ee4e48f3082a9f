package guest

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
)

// The sandbox's side of its egress link (Config.Network). The host only
// forwards what reaches the worker's proxy and resolver, so all the guest
// needs is the resolver's address in resolv.conf, the egress CA in the
// trust store (for HTTPS the proxy intercepts) and, in a VM, its NIC up
// with the address and a default route (link.go).
//
// What to do when applying fails: a bad configuration (unparseable
// address, not a certificate) is the host's bug and is refused by
// Config.Validate (no agent in ns mode, no ACK in VM mode). A failure to
// apply a valid one (a read-only /etc, a netlink error) is logged and the
// agent goes on: the sandbox then has no (or no verified) way out, which
// fails closed, and refusing would leave it with no agent at all.

// Default paths the network configuration is written to.
const (
	DefaultResolvConfPath = "/etc/resolv.conf"
	DefaultCACertPath     = "/usr/local/share/ca-certificates/space-egress.crt"
	DefaultCABundlePath   = "/etc/ssl/certs/ca-certificates.crt"
)

// Markers of the egress CA's block in the CA bundle: a later activation
// (a move gets a new CA) replaces the block instead of adding another.
const (
	caBlockBegin = "# space-egress-ca begin"
	caBlockEnd   = "# space-egress-ca end"
)

// maxCACertBytes bounds Network.CACert (one certificate, maybe a chain).
const maxCACertBytes = 64 << 10

// Validate reports whether n can be applied; it only checks.
func (n *NetworkConfig) Validate() error {
	var errs []error
	// Address and Gateway go together; both empty means the host
	// configures the interface (the ns substrate's veth), so only the
	// resolver and the CA are the agent's.
	if n.Address != "" || n.Gateway != "" {
		p, err := netip.ParsePrefix(n.Address)
		if err != nil || !p.Addr().Is4() || p.Bits() == 0 {
			errs = append(errs, fmt.Errorf("network: address %q is not an IPv4 address with a prefix", n.Address))
		}
		gw, err := netip.ParseAddr(n.Gateway)
		if err != nil || !gw.Is4() {
			errs = append(errs, fmt.Errorf("network: gateway %q is not an IPv4 address", n.Gateway))
		} else if p.IsValid() && (!p.Masked().Contains(gw) || gw == p.Addr()) {
			errs = append(errs, fmt.Errorf("network: gateway %s is not another address of %s", gw, p))
		}
	}
	if a, err := netip.ParseAddr(n.DNS); err != nil || a.Zone() != "" {
		errs = append(errs, fmt.Errorf("network: dns %q is not an IP address", n.DNS))
	}
	if n.MAC != "" {
		if hw, err := net.ParseMAC(n.MAC); err != nil || len(hw) != 6 {
			errs = append(errs, fmt.Errorf("network: mac %q is not an Ethernet address", n.MAC))
		}
	}
	if n.MTU != 0 && (n.MTU < 68 || n.MTU > 65535) {
		errs = append(errs, fmt.Errorf("network: mtu %d out of range [68, 65535]", n.MTU))
	}
	if n.CACert != "" {
		if _, err := parseCACert(n.CACert); err != nil {
			errs = append(errs, fmt.Errorf("network: ca_cert: %w", err))
		}
	}
	return errors.Join(errs...)
}

// parseCACert checks that s is PEM holding certificates only (at least
// one, each parseable) and returns it re-encoded: nothing but the
// certificates reaches the trust store.
func parseCACert(s string) ([]byte, error) {
	if len(s) > maxCACertBytes {
		return nil, fmt.Errorf("%d bytes, more than %d", len(s), maxCACertBytes)
	}
	rest := []byte(s)
	var out bytes.Buffer
	for {
		var b *pem.Block
		b, rest = pem.Decode(rest)
		if b == nil {
			break
		}
		if b.Type != "CERTIFICATE" {
			return nil, fmt.Errorf("PEM block %q is not a certificate", b.Type)
		}
		if _, err := x509.ParseCertificate(b.Bytes); err != nil {
			return nil, err
		}
		if err := pem.Encode(&out, &pem.Block{Type: "CERTIFICATE", Bytes: b.Bytes}); err != nil {
			return nil, err
		}
	}
	if len(bytes.TrimSpace(rest)) != 0 {
		return nil, errors.New("trailing data that is not PEM")
	}
	if out.Len() == 0 {
		return nil, errors.New("no certificate")
	}
	return out.Bytes(), nil
}

// applyNetworkFiles writes the resolver and the egress CA of c.Network
// (validated) to c's paths. Idempotent: applied again with the same
// configuration it leaves the same files. A nil Network changes nothing.
func applyNetworkFiles(c Config) error {
	n := c.Network
	if n == nil {
		return nil
	}
	var errs []error
	if err := writeFileAtomic(c.ResolvConfPath, []byte("nameserver "+n.DNS+"\n"), 0o644); err != nil {
		errs = append(errs, fmt.Errorf("resolv.conf: %w", err))
	}
	if err := applyCACert(c.CACertPath, c.CABundlePath, n.CACert); err != nil {
		errs = append(errs, err)
	}
	return errors.Join(errs...)
}

// applyCACert writes pemText to certPath and makes bundlePath hold it in
// exactly one marked block, replacing the block of an earlier activation.
// An empty pemText removes both: a stale CA must not stay trusted.
func applyCACert(certPath, bundlePath, pemText string) error {
	var cert []byte
	if pemText != "" {
		var err error
		if cert, err = parseCACert(pemText); err != nil {
			return fmt.Errorf("ca certificate: %w", err)
		}
	}
	old, err := os.ReadFile(bundlePath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("ca bundle: %w", err)
	}
	bundle := stripCABlocks(old)
	if cert != nil {
		if len(bundle) > 0 && bundle[len(bundle)-1] != '\n' {
			bundle = append(bundle, '\n')
		}
		bundle = append(bundle, caBlockBegin+"\n"...)
		bundle = append(bundle, cert...)
		bundle = append(bundle, caBlockEnd+"\n"...)
	}
	if old == nil && cert == nil {
		// Nothing there, nothing to trust: do not create an empty bundle.
	} else if !bytes.Equal(old, bundle) {
		if err := writeFileAtomic(bundlePath, bundle, 0o644); err != nil {
			return fmt.Errorf("ca bundle: %w", err)
		}
	}
	if cert == nil {
		if err := os.Remove(certPath); err != nil && !errors.Is(err, os.ErrNotExist) {
			return fmt.Errorf("ca certificate: %w", err)
		}
		return nil
	}
	if err := writeFileAtomic(certPath, cert, 0o644); err != nil {
		return fmt.Errorf("ca certificate: %w", err)
	}
	return nil
}

// stripCABlocks returns b without any marked egress CA block (an
// unterminated one runs to the end: it can only be ours, cut short).
func stripCABlocks(b []byte) []byte {
	if len(b) == 0 {
		return b
	}
	var out []byte
	in := false
	for _, line := range strings.SplitAfter(string(b), "\n") {
		t := strings.TrimRight(line, "\r\n")
		switch {
		case !in && t == caBlockBegin:
			in = true
		case in && t == caBlockEnd:
			in = false
		case !in:
			out = append(out, line...)
		}
	}
	if out == nil {
		out = []byte{}
	}
	return out
}

// writeFileAtomic replaces path with a file holding data: a temporary
// file in the same directory (created with its parents when missing),
// synced, renamed over path. A symbolic link at path is replaced by the
// file, not followed (some images link resolv.conf to a resolver's).
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	f, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp) // a no-op once renamed
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Chmod(perm); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}
