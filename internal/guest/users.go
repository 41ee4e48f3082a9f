package guest

import (
	"bufio"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
)

// account is a user resolved from the passwd/group files.
type account struct {
	Name   string
	UID    uint32
	GID    uint32
	Home   string
	Shell  string
	Groups []uint32 // supplementary groups, primary included
}

// errUnknownUser is returned when a user is not in the passwd file.
var errUnknownUser = errors.New("unknown user")

// userDB is a parsed snapshot of the passwd and group files. Files are small
// and change rarely; they are re-read on every request so that users added by
// a template (useradd) are seen without restarting the agent.
type userDB struct {
	users  []account
	groups []group
}

type group struct {
	name    string
	gid     uint32
	members []string
}

func loadUserDB(passwdPath, groupPath string) (*userDB, error) {
	db := &userDB{}
	err := scanColonFile(passwdPath, func(f []string) {
		if len(f) < 7 {
			return
		}
		uid, err1 := strconv.ParseUint(f[2], 10, 32)
		gid, err2 := strconv.ParseUint(f[3], 10, 32)
		if err1 != nil || err2 != nil || f[0] == "" {
			return
		}
		db.users = append(db.users, account{Name: f[0], UID: uint32(uid), GID: uint32(gid), Home: f[5], Shell: f[6]})
	})
	if err != nil {
		return nil, fmt.Errorf("reading passwd: %w", err)
	}
	err = scanColonFile(groupPath, func(f []string) {
		if len(f) < 4 {
			return
		}
		gid, err := strconv.ParseUint(f[2], 10, 32)
		if err != nil {
			return
		}
		var members []string
		if f[3] != "" {
			members = strings.Split(f[3], ",")
		}
		db.groups = append(db.groups, group{name: f[0], gid: uint32(gid), members: members})
	})
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("reading group: %w", err)
	}
	return db, nil
}

func scanColonFile(path string, fn func([]string)) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 0, 4096), 1<<20)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" || line[0] == '#' {
			continue
		}
		fn(strings.Split(line, ":"))
	}
	return sc.Err()
}

// lookup returns the account of name with its supplementary groups.
func (db *userDB) lookup(name string) (*account, error) {
	for _, u := range db.users {
		if u.Name != name {
			continue
		}
		a := u
		a.Groups = []uint32{a.GID}
		for _, g := range db.groups {
			if g.gid == a.GID {
				continue
			}
			for _, m := range g.members {
				if m == name {
					a.Groups = append(a.Groups, g.gid)
					break
				}
			}
		}
		return &a, nil
	}
	return nil, fmt.Errorf("%w %s", errUnknownUser, name)
}

// userName returns the name of uid, or the number when unknown.
func (db *userDB) userName(uid uint32) string {
	for _, u := range db.users {
		if u.UID == uid {
			return u.Name
		}
	}
	return strconv.FormatUint(uint64(uid), 10)
}

// groupName returns the name of gid, or the number when unknown.
func (db *userDB) groupName(gid uint32) string {
	for _, g := range db.groups {
		if g.gid == gid {
			return g.name
		}
	}
	return strconv.FormatUint(uint64(gid), 10)
}
