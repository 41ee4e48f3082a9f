package sbxnet

import (
	"fmt"

	"github.com/google/nftables"
	"github.com/google/nftables/binaryutil"
	"github.com/google/nftables/expr"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// nftConn is an nftables connection whose netlink sockets are made in ns
// (mdlayher/socket moves a locked thread there and lets it die if it cannot
// move it back).
func nftConn(ns netns.NsHandle) (*nftables.Conn, error) {
	c, err := nftables.New(nftables.WithNetNSFd(int(ns)))
	if err != nil {
		return nil, fmt.Errorf("sbxnet: nftables: %w", err)
	}
	return c, nil
}

var ourTable = &nftables.Table{Family: nftables.TableFamilyINet, Name: TableName}

// installRuleset replaces our table with the ruleset in one batch: the
// add-delete-add of the table makes the delete valid whether or not a table
// was there, and the kernel applies all of it or none.
func installRuleset(ns netns.NsHandle, proxyPort, dnsPort uint16) error {
	c, err := nftConn(ns)
	if err != nil {
		return err
	}
	c.AddTable(ourTable)
	c.DelTable(ourTable)
	t := c.AddTable(ourTable)

	pre := c.AddChain(&nftables.Chain{
		Name: "prerouting", Table: t, Type: nftables.ChainTypeNAT,
		Hooknum: nftables.ChainHookPrerouting, Priority: nftables.ChainPriorityNATDest,
	})
	drop := nftables.ChainPolicyDrop
	input := c.AddChain(&nftables.Chain{
		Name: "input", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookInput, Priority: nftables.ChainPriorityFilter, Policy: &drop,
	})
	c.AddChain(&nftables.Chain{
		Name: "forward", Table: t, Type: nftables.ChainTypeFilter,
		Hooknum: nftables.ChainHookForward, Priority: nftables.ChainPriorityFilter, Policy: &drop,
	})

	rule := func(ch *nftables.Chain, e ...expr.Any) {
		c.AddRule(&nftables.Rule{Table: t, Chain: ch, Exprs: e})
	}
	// prerouting: DNS first (tcp 53 too), then every other TCP connection.
	rule(pre, cat(iifSandbox(), l4(unix.IPPROTO_UDP), dport(53), redirect(dnsPort))...)
	rule(pre, cat(iifSandbox(), l4(unix.IPPROTO_TCP), dport(53), redirect(dnsPort))...)
	rule(pre, cat(iifSandbox(), l4(unix.IPPROTO_TCP), redirect(proxyPort))...)

	// input: only the redirected ports, from sandbox links; replies.
	rule(input,
		&expr.Ct{Register: 1, Key: expr.CtKeySTATE},
		&expr.Bitwise{SourceRegister: 1, DestRegister: 1, Len: 4,
			Mask: binaryutil.NativeEndian.PutUint32(expr.CtStateBitESTABLISHED | expr.CtStateBitRELATED),
			Xor:  binaryutil.NativeEndian.PutUint32(0)},
		&expr.Cmp{Op: expr.CmpOpNeq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(0)},
		accept())
	// lo is ifindex 1 in every namespace.
	rule(input,
		&expr.Meta{Key: expr.MetaKeyIIF, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.NativeEndian.PutUint32(1)},
		accept())
	rule(input, cat(iifSandbox(), l4(unix.IPPROTO_TCP), dport(proxyPort), []expr.Any{accept()})...)
	rule(input, cat(iifSandbox(), l4(unix.IPPROTO_TCP), dport(dnsPort), []expr.Any{accept()})...)
	rule(input, cat(iifSandbox(), l4(unix.IPPROTO_UDP), dport(dnsPort), []expr.Any{accept()})...)

	if err := c.Flush(); err != nil {
		return fmt.Errorf("sbxnet: install ruleset: %w", err)
	}
	return nil
}

// deleteRuleset removes our table; none is not an error.
func deleteRuleset(ns netns.NsHandle) error {
	c, err := nftConn(ns)
	if err != nil {
		return err
	}
	c.AddTable(ourTable)
	c.DelTable(ourTable)
	if err := c.Flush(); err != nil {
		return fmt.Errorf("sbxnet: delete ruleset: %w", err)
	}
	return nil
}

func cat(parts ...[]expr.Any) []expr.Any {
	var out []expr.Any
	for _, p := range parts {
		out = append(out, p...)
	}
	return out
}

// iifSandbox is iifname "sx*": a compare of the name's first bytes only.
func iifSandbox() []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyIIFNAME, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte(LinkPrefix)},
	}
}

func l4(proto byte) []expr.Any {
	return []expr.Any{
		&expr.Meta{Key: expr.MetaKeyL4PROTO, Register: 1},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: []byte{proto}},
	}
}

// dport matches the transport header's destination port (tcp and udp
// alike); it must follow an l4 match.
func dport(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Payload{DestRegister: 1, Base: expr.PayloadBaseTransportHeader, Offset: 2, Len: 2},
		&expr.Cmp{Op: expr.CmpOpEq, Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
	}
}

// redirect is "redirect to :p": to the incoming link's own address (the
// gateway), so the listener's local address names the sandbox.
func redirect(p uint16) []expr.Any {
	return []expr.Any{
		&expr.Immediate{Register: 1, Data: binaryutil.BigEndian.PutUint16(p)},
		&expr.Redir{RegisterProtoMin: 1},
	}
}

func accept() expr.Any { return &expr.Verdict{Kind: expr.VerdictAccept} }
